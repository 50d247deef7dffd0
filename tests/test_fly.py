"""``fly`` (FLy, arXiv 2511.22972): its rule on cases worked out by hand from the definition, each of
its entropies on a small vocabulary, its reduction to the strict rule where its gate never opens, its
settings' checks, its batches, and its P_V (conditional on the drafts) against an enumeration of the
native verdicts and against its own verdicts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from mars_bench.verification import Reason, VerifyInput, batch_steps, get_verifier
from mars_bench.verification.fly import fly_entropy
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)
EXACT, RELAXED, SAMPLED, REJECTED = int(Reason.EXACT), int(Reason.RELAXED), int(Reason.SAMPLED), int(Reason.REJECTED)


def logs(*probs: float) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def peaked(token: int, vocab: int = 4) -> list[float]:
    return [5.0 if index == token else 0.0 for index in range(vocab)]


HIGH = logs(0.5, 0.3, 0.2, 0.0)  # argmax 0; top-3 entropy -(.5 ln .5 + .3 ln .3 + .2 ln .2) = 1.0297 nats; token 3 ruled out
LOW = logs(0.97, 0.01, 0.01, 0.01)  # argmax 0; top-3 entropy -(.97 ln .97 + 2 (.01 ln .01)) = 0.1217 nats


def chain(rows: list[list[float]], drafts: list[int], sampling: SamplingParams = GREEDY, **extra) -> VerifyInput:
    return VerifyInput(torch.tensor(drafts), torch.arange(-1, len(drafts) - 1), torch.tensor(rows), sampling, **extra)


# --- the rule, greedy, by hand ---------------------------------------------------------------

CASES = {
    # A mismatch (1, the argmax 0) at entropy 1.03 >= 0.3, then a match: the official window of 2 is
    # the mismatch and the next draft, and 0 + 2 < 3 drafts; the mismatch at 2 has no room for a window.
    "kept": ([HIGH, peaked(2), peaked(0), peaked(1)], [1, 2, 3], {"window": 2}, [0, 1], 0, [RELAXED, EXACT, REJECTED]),
    "low-entropy": ([LOW, peaked(2), peaked(0), peaked(1)], [1, 2, 3], {"window": 2}, [], 0, [REJECTED]),
    "broken-window": ([HIGH, peaked(2), peaked(0), peaked(1)], [1, 3, 3], {"window": 2}, [], 0, [REJECTED]),
    "ruled-out-draft": ([HIGH, peaked(2), peaked(0), peaked(1)], [3, 2, 3], {"window": 2}, [], 0, [REJECTED]),
    # Two drafts: the official code keeps its last W = 2 positions native, so nothing relaxes; vLLM's next
    # W = 1 drafts and SecureSD's next W = 2 positions (the bonus counting as a match) both read draft 1.
    "official-tail": ([HIGH, peaked(2), peaked(1)], [1, 2], {"window": 2}, [], 0, [REJECTED]),
    "vllm-next": ([HIGH, peaked(2), peaked(1)], [1, 2], {"window": 1, "window_from": "next"}, [0, 1], 1, [RELAXED, EXACT]),
    "vllm-no-room": ([HIGH, peaked(2), peaked(1)], [1, 2], {"window": 2, "window_from": "next"}, [], 0, [REJECTED]),
    "securesd-to-bonus": (
        [HIGH, peaked(2), peaked(1)], [1, 2], {"window": 2, "window_from": "next_or_bonus"}, [0, 1], 1, [RELAXED, EXACT],
    ),
    "securesd-window": (
        [HIGH, peaked(2), peaked(1)], [1, 3], {"window": 2, "window_from": "next_or_bonus"}, [], 0, [REJECTED],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_greedy_keeps_a_high_entropy_mismatch_exactly_when_its_window_holds(case):
    rows, drafts, options, accepted, token, reasons = CASES[case]
    for native in ("pq", "two_samples", "argmax"):  # at T = 0 every native test is argmax matching
        verdict = get_verifier("fly", native=native, **options).verify(chain(rows, drafts))
        assert verdict.accepted.tolist() == accepted and verdict.next_token == token, (native, verdict)
        assert verdict.decisions.reasons.tolist() == reasons


def test_the_window_reads_native_verdicts_after_a_relaxation_and_a_later_mismatch_can_relax_too():
    # Five drafts, official window 2: mismatches at 0 and 2, each followed by a match, both high entropy; 2 + 2 < 5.
    rows = [HIGH, peaked(2), HIGH, peaked(3), peaked(1), peaked(0)]
    verdict = get_verifier("fly", window=2).verify(chain(rows, [1, 2, 1, 3, 1]))
    assert verdict.accepted.tolist() == [0, 1, 2, 3, 4] and verdict.next_token == 0
    assert verdict.decisions.reasons.tolist() == [RELAXED, EXACT, RELAXED, EXACT, EXACT]
    # A relaxed draft is no native accept: it cannot vouch for an earlier mismatch's window.
    verdict = get_verifier("fly", window=2).verify(chain([HIGH, HIGH, peaked(3), peaked(1), peaked(0)], [1, 1, 3, 1]))
    assert verdict.accepted.tolist() == [] and verdict.next_token == 0


# --- the three entropies, by hand ------------------------------------------------------------

RAW = [2.0, 1.0, 0.0, -1.0]


def entropy_of(probs: list[float]) -> float:
    return -sum(p * math.log(p) for p in probs if p > 0)


def softmax(values: list[float]) -> list[float]:
    weights = [math.exp(value) for value in values]
    return [weight / sum(weights) for weight in weights]


def test_each_entropy_form_by_hand():
    sampling = SamplingParams(temperature=0.5, top_k=2)
    raw = torch.tensor([RAW])
    processed = process_logits(raw, sampling)  # [2, 1, -inf, -inf]
    expected = {
        "top3_raw": entropy_of(softmax(RAW)[:3]),  # unscaled, unfiltered: 0.8372
        "top3_processed": entropy_of(softmax([4.0, 2.0])),  # top-k 2 at T = 0.5: 0.3653
        "normalised": entropy_of(softmax([4.0, 2.0, 0.0, -2.0])) / math.log(4),  # T-scaled, unfiltered: 0.3285
    }
    for form, value in expected.items():
        assert float(fly_entropy(form, raw, processed, sampling)[0]) == pytest.approx(value, abs=1e-6), form
    greedy = {  # T = 0: vLLM's all-greedy entropy is the raw logits' too; SecureSD scales by 1
        "top3_raw": entropy_of(softmax(RAW)[:3]),
        "top3_processed": entropy_of(softmax(RAW)[:3]),
        "normalised": entropy_of(softmax(RAW)) / math.log(4),
    }
    for form, value in greedy.items():
        assert float(fly_entropy(form, raw, process_logits(raw, GREEDY), GREEDY)[0]) == pytest.approx(value, abs=1e-6), form
    one = torch.tensor([[3.0]])  # V = 1: no entropy, and SecureSD's log V = 0 is no division
    assert [float(fly_entropy(form, one, one, GREEDY)[0]) for form in expected] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("form", "value"), [
    ("top3_raw", entropy_of(softmax(RAW)[:3])),
    ("top3_processed", entropy_of(softmax([4.0, 2.0]))),
    ("normalised", entropy_of(softmax([4.0, 2.0, 0.0, -2.0])) / math.log(4)),
])  # fmt: skip
def test_the_gate_opens_at_its_entropy(form, value):
    # Draft 1 (the runner-up, kept by top-k 2) mismatches; draft 2 is row 1's argmax: the gate alone decides.
    step = chain([RAW, peaked(2), peaked(1)], [1, 2], SamplingParams(temperature=0.5, top_k=2))
    for threshold, kept in ((value - 1e-4, 2), (value + 1e-4, 0)):
        verifier = get_verifier("fly", entropy=threshold, entropy_form=form, window=1, window_from="next", native="argmax")
        assert verifier.verify(step, generator=torch.Generator().manual_seed(0)).accepted_len == kept, threshold


# --- a gate that never opens is the strict rule ---------------------------------------------


def random_chain(seed: int, sampling: SamplingParams, dists: bool, vocab: int = 6) -> VerifyInput:
    generator = torch.Generator().manual_seed(seed)
    count = 1 + seed % 5
    logits = torch.randn(count + 1, vocab, generator=generator) * 2
    order = logits.argsort(dim=-1, descending=True)
    picks = torch.randint(0, 2, (count,), generator=generator)  # the argmax or the runner-up: windows hold often
    drafts, parents = order[torch.arange(count), picks], torch.arange(-1, count - 1)
    if not dists:
        return VerifyInput(drafts, parents, logits, sampling, draft_probs=torch.rand(count, generator=generator))
    q = torch.softmax(torch.randn(count, vocab, generator=generator) * 2, dim=-1)
    return VerifyInput(drafts, parents, logits, sampling, draft_probs=q[torch.arange(count), drafts], draft_dists=q)


NEVER = [
    {"entropy": 5.0, "window": 1},  # above any top-3 entropy (<= ln 3 nats) and any normalised one (<= 1)
    {"entropy": 5.0, "entropy_form": "normalised", "window_from": "next_or_bonus", "window": 1},
    {"entropy": 5.0, "entropy_form": "top3_processed", "window_from": "next", "window": 1},
    {"entropy": 0.0, "window": 7},  # no room for the window in five drafts
]


@pytest.mark.parametrize("options", NEVER, ids=[str(options) for options in NEVER])
def test_a_gate_that_never_opens_is_exact_or_rejection_exactly(options):
    fly = get_verifier("fly", **options)
    modes = ((GREEDY, get_verifier("exact")), (SamplingParams(temperature=0.8, top_k=4), get_verifier("rejection")))
    for sampling, strict in modes:
        for seed in range(12):
            step = random_chain(seed, sampling, dists=seed % 2 == 1 and not sampling.greedy)
            ours = fly.verify(step, generator=torch.Generator().manual_seed(seed))
            theirs = strict.verify(step, generator=torch.Generator().manual_seed(seed))
            assert ours.accepted.tolist() == theirs.accepted.tolist() and ours.next_token == theirs.next_token, seed
            assert ours.decisions.reasons.tolist() == theirs.decisions.reasons.tolist(), seed
            mine, strict_emission = fly.emission(step), strict.emission(step)
            torch.testing.assert_close(mine.dist, strict_emission.dist, rtol=0, atol=1e-7)
            torch.testing.assert_close(mine.accept, strict_emission.accept, rtol=0, atol=1e-7)


# --- settings -------------------------------------------------------------------------------

BAD = [
    ({"entropy": -0.1}, "entropy=-0.1 is invalid: allowed is a finite number >= 0"),
    ({"entropy": math.inf}, "entropy=inf is invalid: allowed is a finite number >= 0"),
    ({"entropy": "high"}, "entropy='high' is invalid: allowed is a finite number >= 0"),
    ({"window": 0}, "window=0 is invalid: allowed is an integer >= 1"),
    ({"window": 2.5}, "window=2.5 is invalid: allowed is an integer >= 1"),
    ({"window": True}, "window=True is invalid: allowed is an integer >= 1"),
    ({"entropy_form": "top5"}, "entropy_form='top5' is invalid: allowed are top3_raw, top3_processed, normalised"),
    ({"window_from": "before"}, "window_from='before' is invalid: allowed are mismatch, next, next_or_bonus"),
    ({"native": "coin"}, "native='coin' is invalid: allowed are pq, two_samples, argmax"),
    ({"windows": 3}, "verifier fly has no setting 'windows': allowed are entropy, window, entropy_form, window_from, native"),
]


@pytest.mark.parametrize(("options", "message"), BAD, ids=[str(options) for options, _ in BAD])
def test_a_bad_setting_is_refused_in_one_line(options, message):
    with pytest.raises(ValueError) as error:
        get_verifier("fly", **options)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_defaults_and_trees():
    verifier = get_verifier("fly")
    assert verifier.describe() == {"name": "fly", "entropy": 0.3, "window": 6, "entropy_form": "top3_raw",
                                   "window_from": "mismatch", "native": "pq"}  # fmt: skip
    assert verifier.chains_only and not verifier.lossless and verifier.emission_given_drafts
    tree = VerifyInput(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.zeros(3, 4), SAMPLE)
    for call in (verifier.emission, verifier.verify):
        with pytest.raises(ValueError, match="^verifier fly judges chains only: got a tree of drafts"):
            call(tree)


# --- batches --------------------------------------------------------------------------------

FIRING = [
    {"entropy": 0.2, "window": 1, "window_from": "next"},
    {"entropy": 0.4, "window": 2, "native": "two_samples"},
    {"entropy": 0.1, "window": 2, "window_from": "next_or_bonus", "native": "argmax", "entropy_form": "normalised"},
    {"entropy": 0.2, "window": 1, "entropy_form": "top3_processed"},
]


@pytest.mark.parametrize("options", FIRING, ids=[str(options) for options in FIRING])
def test_a_batch_gives_every_request_its_own_verdict_and_emission(options):
    fly = get_verifier("fly", **options)
    relaxed = 0
    for sampling in (GREEDY, SamplingParams(temperature=0.7, top_k=4)):
        for seed in range(0, 40, 5):
            steps = [random_chain(seed + request, sampling, dists=not sampling.greedy and seed % 2 == 0) for request in range(5)]
            batch = batch_steps(steps)
            verdicts = fly.verify_batch(batch, generator=[torch.Generator().manual_seed(seed + r) for r in range(5)])
            for request, (step, verdict) in enumerate(zip(steps, verdicts)):
                alone = fly.verify(step, generator=torch.Generator().manual_seed(seed + request))
                assert verdict.accepted.tolist() == alone.accepted.tolist() and verdict.next_token == alone.next_token
                assert verdict.decisions.reasons.tolist() == alone.decisions.reasons.tolist()
                relaxed += verdict.decisions.relaxed_count
            for step, emission in zip(steps, fly.emission_batch(batch)):
                alone = fly.emission(step)
                torch.testing.assert_close(emission.dist, alone.dist, rtol=0, atol=1e-6)
                torch.testing.assert_close(emission.accept, alone.accept, rtol=0, atol=1e-6)
    assert relaxed > 0  # the batches exercised the override


# --- P_V, conditional on the drafts ------------------------------------------------------------


def window_of(i: int, count: int, width: int, convention: str) -> tuple[bool, range]:
    """(fits, the positions read) of an override at i of ``count`` drafts, as each port's code writes it."""
    if convention == "mismatch":  # official: the pattern [mismatch, W - 1 matches]; the last W positions stay native
        return i + width < count, range(i + 1, i + width)
    if convention == "next":  # vLLM: pos + W < num_draft_tokens, offsets 1..W
        return i + width < count, range(i + 1, i + width + 1)
    return i + width <= count, range(i + 1, min(i + width, count - 1) + 1)  # SecureSD: steps + W > K rejects


def enumerated(verifier, step: VerifyInput) -> tuple[torch.Tensor, torch.Tensor]:
    """P_V [D, V] and alpha_V [D] from the definition: per row j, x_j ~ q_j (the other drafts as given) and
    every pattern of the native verdicts (independent, each with its native probability), the walk's
    emission at j where it reaches j, normalised by the probability of reaching j (a row no walk reaches:
    judged as if the walk began there)."""
    params, sampling = verifier.params, step.sampling
    processed = process_logits(step.target_logits, sampling)
    probs = probabilities(processed, sampling).double()
    count, vocab = step.num_drafts, probs.shape[-1]
    drafts = step.draft_tokens.tolist()
    proposal = step.draft_dists if step.draft_dists is not None else torch.nn.functional.one_hot(step.draft_tokens, vocab)
    p, q = probs.tolist(), proposal.double().tolist()
    gate = (fly_entropy(params.entropy_form, step.target_logits, processed, sampling) >= params.entropy).tolist()
    windows = [window_of(k, count, params.window, params.window_from) for k in range(count)]

    def native(k: int, x: int) -> float:
        if params.native == "pq":
            return min(1.0, p[k][x] / q[k][x])
        if params.native == "two_samples":
            return 1.0 - (1.0 - p[k][x]) ** 2
        return float(x == max(range(vocab), key=lambda token: (p[k][token], -token)))

    def correction(k: int, x: int) -> torch.Tensor:
        if params.native == "pq":
            residual = (probs[k] - torch.tensor(q[k], dtype=torch.float64)).clamp(min=0.0)
            return residual / residual.sum()
        if params.native == "two_samples":
            without = probs[k].clone()
            without[x] = 0.0
            return without / without.sum()
        return probs[k]

    def row(j: int, reaching: bool) -> tuple[torch.Tensor, float, float]:
        joint, reached, kept = torch.zeros(vocab, dtype=torch.float64), 0.0, 0.0
        for x in (token for token in range(vocab) if q[j][token] > 0):
            tokens = drafts[:j] + [x] + drafts[j + 1 :]
            chances = [native(k, tokens[k]) for k in range(count)]
            for verdicts in itertools.product((False, True), repeat=count):
                weight = q[j][x] * math.prod(chance if passed else 1.0 - chance for chance, passed in zip(chances, verdicts))
                overridden = [
                    gate[k] and fits and p[k][tokens[k]] > 0 and all(verdicts[m] for m in window)
                    for k, (fits, window) in enumerate(windows)
                ]
                accepted = [passed or override for passed, override in zip(verdicts, overridden)]
                if weight == 0.0 or (reaching and not all(accepted[:j])):
                    continue
                reached += weight
                if accepted[j]:
                    joint[x] += weight
                    kept += weight
                else:
                    joint += weight * correction(j, x)
        return joint, reached, kept

    dists, accepts = [], []
    for j in range(count):
        joint, reached, kept = row(j, reaching=True)
        if reached == 0.0:
            joint, reached, kept = row(j, reaching=False)
        dists.append(joint / reached)
        accepts.append(kept / reached)
    return torch.stack(dists), torch.tensor(accepts, dtype=torch.float64)


def enumerated_chain(seed: int, dists: bool, sampling: SamplingParams) -> VerifyInput:
    """Four drafts over four tokens, each its row's argmax or runner-up (the draft's q a random
    distribution with ``dists``; every token then has q > 0)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, 4, generator=generator) * 1.5
    order = logits.argsort(dim=-1, descending=True)
    drafts = order[torch.arange(4), torch.tensor([1, 0, 1, 0]) if seed % 2 else torch.tensor([1, 1, 0, 1])]
    if not dists:
        return VerifyInput(drafts, torch.arange(-1, 3), logits, sampling)
    q = torch.softmax(torch.randn(4, 4, generator=generator), dim=-1)
    return VerifyInput(drafts, torch.arange(-1, 3), logits, sampling, draft_dists=q)


@pytest.mark.parametrize("native", ["pq", "two_samples", "argmax"])
@pytest.mark.parametrize("convention", ["mismatch", "next", "next_or_bonus"])
def test_the_emission_is_the_law_given_the_drafts_and_the_walk_reaching_the_row(native, convention):
    for width, dists, sampling in ((1, False, SAMPLE), (2, True, SAMPLE), (2, False, SamplingParams(temperature=0.8, top_k=3))):
        verifier = get_verifier("fly", entropy=0.2, window=width, window_from=convention, native=native)
        for seed in range(2):
            step = enumerated_chain(seed, dists, sampling)
            dist, accept = enumerated(verifier, step)
            emission = verifier.emission(step)
            where = f"W={width}, dists={dists}, {sampling}, seed {seed}"
            torch.testing.assert_close(emission.dist.double(), dist, rtol=0, atol=2e-6, msg=where)
            torch.testing.assert_close(emission.accept.double(), accept, rtol=0, atol=2e-6, msg=where)


VERDICT_CASES = [
    {"entropy": 0.0, "window": 1, "window_from": "next"},
    {"entropy": 0.0, "window": 2, "window_from": "next_or_bonus", "native": "two_samples"},
    {"entropy": 0.0, "window": 1, "native": "argmax"},
]


@pytest.mark.parametrize("options", VERDICT_CASES, ids=[str(options) for options in VERDICT_CASES])
def test_verdicts_emit_what_the_emission_states(options):
    """3,000 walks over one chain of deterministic drafts (the emission's conditioning): at each row, the
    keep rate and the tokens emitted among the walks that reached it."""
    logits = torch.tensor([[1.0, 0.8, 0.0, -1.0], [0.5, 1.5, 0.0, 0.2], [0.0, 0.3, 1.2, 0.9], [1.0, 0.0, 0.0, 0.5]])
    step = chain(logits.tolist(), [1, 1, 3], SAMPLE)  # the runner-up, the argmax, the runner-up
    verifier = get_verifier("fly", **options)
    emission = verifier.emission(step)
    draws = 3_000
    verdicts = verifier.verify_batch(batch_steps([step] * draws), generator=torch.Generator().manual_seed(17))
    for row in range(3):
        reached = [verdict for verdict in verdicts if verdict.accepted_len >= row]
        kept = sum(verdict.accepted_len > row for verdict in reached)
        alpha = float(emission.accept[row])
        spread = math.sqrt(len(reached) * alpha * (1 - alpha)) or 1.0
        assert abs(kept - len(reached) * alpha) / spread < 4.5, (row, kept, len(reached), alpha)
        counts = torch.zeros(4)
        for verdict in reached:
            counts[int(step.draft_tokens[row]) if verdict.accepted_len > row else verdict.next_token] += 1
        dist = emission.dist[row]
        assert not counts[dist == 0].any(), (row, counts, dist)  # no token the emission rules out
        possible = dist > 0
        assert chi_square(counts[possible].tolist(), dist[possible].tolist()) > 1e-4, (row, counts, dist)


def chi_square(counts: list[float], dist: list[float]) -> float:
    """The p-value of token counts against ``dist`` (tokens it allows), cells expecting < 5 draws pooled."""
    total, mass = sum(counts), sum(dist)
    expected = [share / mass * total for share in dist]
    common = [index for index, value in enumerate(expected) if value >= 5.0]
    rare = [index for index in range(len(dist)) if index not in common]
    observed = [counts[index] for index in common] + ([sum(counts[index] for index in rare)] if rare else [])
    predicted = [expected[index] for index in common] + ([sum(expected[index] for index in rare)] if rare else [])
    if len(observed) < 2:
        return 1.0  # one cell: the counts match the total by construction
    statistic = sum((seen - wanted) ** 2 / wanted for seen, wanted in zip(observed, predicted))
    return float(chi2.sf(statistic, len(observed) - 1))


def test_a_row_reached_only_through_a_window_with_a_vanishing_proposal_is_still_a_distribution():
    """Row 1 is reached only inside row 0's window, and its draft is natively accepted only for a
    token whose q is 1.18e-38 (float32's smallest normal): P_V there is that token, not a ~1e-8 mass
    lost to a division guard (a case hypothesis found)."""
    tiny = torch.finfo(torch.float32).tiny
    q = torch.tensor([[0.0, 0.0, 1.0], [1.0, tiny, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    logits = [[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    step = chain(logits, [2, 0, 0], SamplingParams(temperature=0.5), draft_dists=q, draft_probs=torch.tensor([1.0, 1.0, 1 / 3]))
    verifier = get_verifier("fly", entropy=0.1, window=1, window_from="next_or_bonus", native="argmax", entropy_form="normalised")
    emission = verifier.emission(step)
    dist, accept = enumerated(verifier, step)
    torch.testing.assert_close(emission.dist.double().sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(emission.dist.double(), dist, rtol=0, atol=2e-6)
    torch.testing.assert_close(emission.accept.double(), accept, rtol=0, atol=2e-6)
