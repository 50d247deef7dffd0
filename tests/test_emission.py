"""``emission``: every verifier states the exact distribution P_V of the token it emits at each
judging row and the probability alpha_V that it keeps a draft there; this file holds it to that.

1. Exact vs empirical: ``verify`` run 3,000 times (one batched call) emits, at
   each judging row its walk reaches, tokens distributed as ``emission.dist`` (chi-square) and keeps the row's draft at the rate
   ``emission.accept`` (binomial z), for a chain of sampled drafts, a chain of deterministic
   drafts (under top-k) and a tree of three deterministic root children. At these counts the
   check tells apart the two settings whose emissions are nearest on each case (negative controls).
2. Greedy: P_V is one-hot at exactly the token the (deterministic) verdict emits.
3. Properties over random inputs: every row is a distribution, alpha_V is a probability, the
   lossless rules cost nothing (KL = TV = 0), ``tv_budget`` spends its TV budget exactly,
   ``mentored`` stays within its KL budget, and no rule beats alpha_V <= 1 - TV(q, p) +
   TV(P_V, p), which no rule that emits its kept drafts can.

Every verifier is judged under settings that make its relaxation fire on these inputs
(``LOSSY``; ``test_the_lossy_settings_are_lossy_on_the_empirical_cases`` checks they do), so the
empirical test compares the rule's relaxed branch, not only its strict one. ``LOSSY`` names
exactly the registered verifiers; the tree cases run for the rules that judge trees, and the
others are held to refusing trees.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch
from conftest import SHARES, examples_on_every_core, on_every_core, property_examples
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import chi2

from mars_bench.verification import VerifyInput, available_verifiers, batch_steps, get_verifier
from mars_bench.verification.emission import Emission, fidelity, proposal_rows
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

# Settings per verifier under which its relaxation fires on the empirical cases below (a list
# where one verifier has several rules). Verifiers being added are skipped until they are
# registered, an option until it exists. The entropy gate of 0.95 nats is open on every judging
# row of the cases but the deterministic chain's row 0 (entropy 0.92), so both of its branches run.
LOSSY: dict[str, dict | list[dict]] = {
    "exact": {},
    "rejection": {},
    "mars": [
        {"theta": 0.5},
        {"theta": 0.5, "correction": "target"},
        {"theta": 0.5, "entropy_gate": 0.95},
        {"theta": 0.5, "guard": "none", "sampling": "securesd", "margin_logits": "raw"},  # SecureSD's port
    ],
    "mars_ref": {"theta": 0.5},
    "typical": {"epsilon": 0.3, "delta": 0.9},
    "top_m": {"m": 2},
    "lenient": {"lenience": 0.5},
    "cascade": [{"rule": "chow", "alpha": 0.3}, {"rule": "opt", "alpha": 0.5}],
    "mentored": {"kl_budget": 0.05},
    "tv_budget": {"eps": 0.1},
    "threshold": [{"threshold_acc": 0.5}, {"threshold_single": 0.35, "threshold_acc": 0.6}],
    "fsd": [{"divergence": "js", "threshold": 0.4}, {"divergence": "tv", "threshold": 0.6, "residual": "strict"}],
    "lossy_sd": {"eps": 0.3},
    "bild": {"rollback": 1.5},
    # fly: windows that fit two drafts. The first reads draft 1 from row 0 and relaxes row 1 with the bonus
    # as its window; then vLLM's, SecureSD's (its argmax test emits p after rejecting a deterministic draft)
    # and the official port.
    "fly": [
        {"entropy": 0.1, "window": 1, "window_from": "next_or_bonus"},
        {"entropy": 0.1, "window": 1, "window_from": "next"},
        {"entropy": 0.1, "window": 1, "window_from": "next_or_bonus", "native": "argmax", "entropy_form": "normalised"},
        {"entropy": 0.1, "window": 1, "native": "two_samples"},
    ],
}
# Rules whose P_V is p itself: "mars_ref" is not among them even at theta=None, since its strict
# test divides by the drafter's draft_probs.
LOSSLESS = [("exact", {}), ("rejection", {}), ("mars", {"theta": None}), ("threshold", {})]

# 3,000 draws tell every two settings here whose emissions differ on a case apart, one's verdicts from
# the other's emission: with a power of 0.997 the nearest pair (mentored and tv_budget on the
# deterministic chain), of 0.999 or more every other pair (by the noncentral chi-square and normal
# laws of the check's two tests, worked out when this count replaced 20,000, and 10,000 on the
# deterministic chain). test_the_check_at_its_draw_count_tells_the_nearest_settings_apart runs the
# nearest pair of each case.
DRAWS = 3_000
CONDITIONED_SHARE = 10  # a later row is compared only when at least 1/10 of the walks reached it
MIN_EXPECTED = 5.0
P_FLOOR = 1e-3
Z_LIMIT = 4.0
SAMPLE = SamplingParams(temperature=1.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # every tensor here is tiny


def as_list(value: dict | list[dict]) -> list[dict]:
    return value if isinstance(value, list) else [value]


def label(name: str, options: dict) -> str:
    return name + ("(" + ",".join(f"{key}={value}" for key, value in options.items()) + ")" if options else "")


def same_settings(first: tuple[str, dict], second: tuple[str, dict]) -> bool:
    """Whether two (name, options) pairs build the same verifier (unset options at their defaults)."""
    return first[0] == second[0] and get_verifier(first[0], **first[1]).params == get_verifier(second[0], **second[1]).params


def judges_trees(name: str) -> bool:
    return not get_verifier(name).chains_only


def configs(extra: list[tuple[str, dict]] = (), trees: bool = False, lossy: bool = False) -> list:
    """pytest params (name, options) for every registered verifier's settings in ``LOSSY``, plus
    ``extra`` (each verifier setting once); ``trees``: only verifiers that judge trees; ``lossy``:
    only lossy verifiers."""
    pairs = [(name, options) for name in available_verifiers() for options in as_list(LOSSY[name])]
    for pair in extra:
        if not any(same_settings(pair, known) for known in pairs):
            pairs.append(pair)
    pairs = [(name, options) for name, options in pairs if judges_trees(name) or not trees]
    pairs = [(name, options) for name, options in pairs if not (lossy and get_verifier(name, **options).lossless)]
    return [pytest.param(name, options, id=label(name, options)) for name, options in pairs]


def build(name: str, options: dict):
    return get_verifier(name, **options)


def target_probs(verifier, step: VerifyInput) -> torch.Tensor:
    """p per row [N+1, V] under the verifier's own processing of the target's logits."""
    return probabilities(verifier.process(step.target_logits, step.sampling), step.sampling)


def cost(verifier, step: VerifyInput, emission: Emission):
    """``fidelity`` at the emission's rows, with the proposal for chains (None for trees)."""
    p = target_probs(verifier, step)[emission.rows]
    chain = step.parents.tolist() == list(range(-1, step.num_drafts - 1))
    proposal = proposal_rows(step.draft_tokens, step.draft_dists, p.shape[-1]) if chain else None
    return fidelity(emission, p, proposal)


def walk(step: VerifyInput, verdict) -> dict[int, tuple[int, bool]]:
    """Per target row the verdict's walk reached: (the token emitted there, whether a draft was kept)."""
    path = verdict.accepted.tolist()
    rows = [0] + [node + 1 for node in path]
    return {
        row: (int(step.draft_tokens[path[i]]), True) if i < len(path) else (verdict.next_token, False)
        for i, row in enumerate(rows)
    }


def chi_square_pvalue(counts: torch.Tensor, dist: torch.Tensor) -> float:
    """Goodness of fit of observed token counts [V] to ``dist`` [V]; cells expecting < 5 draws are pooled."""
    counts, dist = counts.double(), dist.double()
    expected = dist / dist.sum() * counts.sum()
    common = expected >= MIN_EXPECTED
    observed = torch.cat([counts[common], counts[~common].sum().reshape(1)])
    predicted = torch.cat([expected[common], expected[~common].sum().reshape(1)])
    if predicted[-1] == 0:  # every rare token has probability 0: none may be drawn
        if observed[-1] > 0:
            return 0.0
        observed, predicted = observed[:-1], predicted[:-1]
    if observed.numel() < 2:
        return 1.0  # one cell: the counts match the total by construction
    statistic = float(((observed - predicted) ** 2 / predicted).sum())
    return float(chi2.sf(statistic, observed.numel() - 1))


def binomial_z(kept: int, reached: int, accept: float) -> float:
    variance = reached * accept * (1.0 - accept)
    gap = kept - reached * accept
    if variance <= 0:
        return 0.0 if abs(gap) < 0.5 else float("inf")
    return gap / variance**0.5


# --- the empirical cases ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A step, and for a chain of sampled drafts the drafter's q to draw its drafts from per run."""

    step: VerifyInput
    resample: torch.Tensor | None = None


def ranked(logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the processed target's tokens by decreasing logit [R, V], and p [R, V]."""
    processed = process_logits(logits, sampling)
    return processed.argsort(dim=-1, descending=True, stable=True), probabilities(processed, sampling)


def margin_logits(seed: int, rows: int, vocab: int, judging: int, sampling: SamplingParams) -> torch.Tensor:
    """Normal logits * 2 from the first seed (counting from ``seed``) whose ``judging`` first rows
    all relax under a margin rule at theta = 0.6 (z1 > 0, z2 > 0.6 z1), and give the runner-up
    p(t2) > 0.3 (so a typical rule with epsilon <= 0.3 keeps it)."""
    while True:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2
        order, p = ranked(logits, sampling)
        z = process_logits(logits, sampling).gather(-1, order[:, :2])
        p2 = p.gather(-1, order[:, 1:2]).squeeze(-1)
        if bool(((z[:, 0] > 0) & (z[:, 1] > 0.6 * z[:, 0]) & (p2 > 0.3))[:judging].all()):
            return logits
        seed += 1


def sampled_chain() -> Case:
    """Two drafts drawn from q, V = 5; q puts 0.8 then 0.5 on each row's runner-up (a drafter confident
    at row 0, less so at row 1: a confidence rule keeps the drafter at one and defers at the other)."""
    logits = margin_logits(0, 3, 5, 2, SAMPLE)
    order, _ = ranked(logits, SAMPLE)
    noise = torch.softmax(torch.randn(2, 5, generator=torch.Generator().manual_seed(100)), dim=-1)
    weight = torch.tensor([[0.8], [0.5]])
    q = (1 - weight) * noise + weight * torch.nn.functional.one_hot(order[:2, 1], 5).float()
    tokens = order[:2, 1]
    step = VerifyInput(tokens, torch.arange(-1, 1), logits, SAMPLE, draft_probs=q[[0, 1], tokens], draft_dists=q)
    return Case(step, resample=q)


def deterministic_chain() -> Case:
    """Two deterministic drafts, each its row's runner-up, V = 6 under top-k 3; the drafter's
    probabilities 0.9 then 0.6 (confident at row 0, less so at row 1)."""
    sampling = SamplingParams(temperature=1.0, top_k=3)
    logits = margin_logits(200, 3, 6, 2, sampling)
    order, _ = ranked(logits, sampling)
    probs = torch.tensor([0.9, 0.6])
    return Case(VerifyInput(order[:2, 1], torch.arange(-1, 1), logits, sampling, draft_probs=probs))


def root_tree() -> Case:
    """Three deterministic root children: the target's third, second and first tokens, in that order."""
    logits = margin_logits(300, 4, 6, 1, SAMPLE)
    order, _ = ranked(logits, SAMPLE)
    tokens = order[0, [2, 1, 0]]
    q = torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(301)), dim=-1)
    return Case(VerifyInput(tokens, torch.tensor([-1, -1, -1]), logits, SAMPLE, draft_probs=q[tokens]))


CASES = {"sampled-chain": sampled_chain, "deterministic-chain-top-k": deterministic_chain, "tree": root_tree}


@dataclass
class Tally:
    """What ``verify`` did over many runs, per judging row: the tokens emitted there, the walks that
    reached it and those that kept its draft."""

    counts: dict[int, torch.Tensor]
    reached: dict[int, int]
    kept: dict[int, int]

    def __add__(self, other: Tally) -> Tally:
        return Tally({row: self.counts[row] + other.counts[row] for row in self.counts},
                     {row: self.reached[row] + other.reached[row] for row in self.reached},
                     {row: self.kept[row] + other.kept[row] for row in self.kept})  # fmt: skip


def run_verify(verifier, case_data: Case, rows: list[int], draws: int, seed: int, redraw: int | None = None) -> Tally:
    """``verify`` run ``draws`` times, the drafts of a sampled chain drawn afresh from q each time (only
    the one at position ``redraw`` where given): a share of the runs on each core, from a generator
    seeded ``seed`` + the share's index."""
    shares = on_every_core(partial(verify_runs, verifier, case_data, rows, draws // SHARES, seed, redraw=redraw))
    return sum(shares[1:], shares[0])


def verify_runs(
    verifier, case_data: Case, rows: list[int], draws: int, seed: int, share: int, redraw: int | None = None
) -> Tally:
    """One core's share of ``run_verify``."""
    generator = torch.Generator().manual_seed(seed + share)
    vocab = case_data.step.target_logits.shape[-1]
    if case_data.resample is not None:
        drafts = torch.multinomial(case_data.resample, draws, replacement=True, generator=generator).t()
        if redraw is not None:
            drafts = torch.where(torch.arange(drafts.shape[1]) == redraw, drafts, case_data.step.draft_tokens)
        draft_probs = case_data.resample.gather(-1, drafts.t()).t()
    tally = Tally({row: torch.zeros(vocab, dtype=torch.long) for row in rows}, dict.fromkeys(rows, 0), dict.fromkeys(rows, 0))
    steps = [case_data.step] * draws
    if case_data.resample is not None:
        steps = [replace(case_data.step, draft_tokens=drafts[draw], draft_probs=draft_probs[draw]) for draw in range(draws)]
    # One call judges every run, each a request of its own (test_batched_verification: the same verdicts as one by one).
    for step, verdict in zip(steps, verifier.verify_batch(batch_steps(steps), generator=generator)):
        for row, (token, kept_draft) in walk(step, verdict).items():
            if row in tally.counts:
                tally.counts[row][token] += 1
                tally.reached[row] += 1
                tally.kept[row] += kept_draft
    return tally


def mismatches(emission: Emission, tally: Tally, draws: int) -> list[str]:
    """Where the tally disagrees with the emission: row 0, and each later row at least 1/10 of the
    walks reached (conditioned on the walk reaching it)."""
    failures = []
    for index, row in enumerate(emission.rows.tolist()):
        reached = tally.reached[row]
        if row > 0 and reached * CONDITIONED_SHARE < draws:
            continue
        dist, accept = emission.dist[index], float(emission.accept[index])
        pvalue = chi_square_pvalue(tally.counts[row], dist)
        if pvalue <= P_FLOOR:
            failures.append(
                f"row {row}: emitted {tally.counts[row].tolist()} in {reached} walks, emission expects "
                f"{[round(float(x) * reached, 1) for x in dist]} (p-value {pvalue:.2e})"
            )
        z = binomial_z(tally.kept[row], reached, accept)
        if abs(z) >= Z_LIMIT:
            failures.append(f"row {row}: kept {tally.kept[row]} of {reached}, emission says alpha_V = {accept:.4f} (z = {z:.1f})")
    return failures


def empirical_params() -> list:
    """(name, options, case): every setting on the chain of sampled drafts (the general formula),
    a verifier's first setting on the other cases too (the options that follow change one branch
    of a rule whose other cases the first setting covers)."""
    params = []
    for param in configs():
        name, options = param.values
        first = options == as_list(LOSSY.get(name, {}))[0]
        cases = [case for case in CASES if case != "tree" or judges_trees(name)] if first else ["sampled-chain"]
        for case in cases:
            params.append(pytest.param(name, options, case, id=f"{param.id}-{case}"))
    return params


@pytest.mark.parametrize(("name", "options", "case"), empirical_params())
@pytest.mark.slow
def test_verify_emits_tokens_distributed_as_the_emission_says(name, options, case):
    verifier = build(name, options)
    case_data = CASES[case]()
    emission = verifier.emission(case_data.step)
    seed = sum(map(ord, label(name, options) + case))
    if case_data.resample is not None and getattr(verifier, "emission_given_drafts", False):
        # P_V at a row is conditional on the other rows' drafts (fly's window reads them): each row is
        # checked against walks that redraw that row's draft alone.
        for index, row in enumerate(emission.rows.tolist()):
            at = slice(index, index + 1)
            alone = Emission(emission.dist[at], emission.accept[at], emission.rows[at])
            assert mismatches(alone, run_verify(verifier, case_data, [row], DRAWS, seed + row, redraw=row), DRAWS) == []
    else:
        assert mismatches(emission, run_verify(verifier, case_data, emission.rows.tolist(), DRAWS, seed), DRAWS) == []
    if case_data.resample is not None:  # P_V marginalises over the drafts: other drafts give the same
        assert marginal_over_drafts(verifier, case_data.step, emission, case_data.resample.argmin(-1))


def marginal_over_drafts(verifier, step: VerifyInput, emission: Emission, others: torch.Tensor) -> bool:
    """Whether ``others`` ([N]) in place of the drafts give the same P_V; for a rule whose P_V at a row is
    conditional on the other rows' drafts (``emission_given_drafts``), each row with its own draft replaced."""
    given = getattr(verifier, "emission_given_drafts", False)
    for row in range(step.num_drafts) if given else [None]:
        tokens = others if row is None else torch.where(torch.arange(step.num_drafts) == row, others, step.draft_tokens)
        probs = None if step.draft_probs is None else step.draft_dists.gather(-1, tokens[:, None])[:, 0]
        again = verifier.emission(replace(step, draft_tokens=tokens, draft_probs=probs))
        at = slice(None) if row is None else slice(row, row + 1)
        same = torch.allclose(again.dist[at], emission.dist[at], atol=1e-6)
        if not (same and torch.allclose(again.accept[at], emission.accept[at], atol=1e-6)):
            return False
    return True


@pytest.mark.slow
def test_the_empirical_check_tells_one_rule_from_another():
    """Negative control: ``rejection``'s verdicts against ``mars(theta=0.5)``'s emission, 2,000 runs."""
    case_data = deterministic_chain()
    emission = get_verifier("mars", theta=0.5).emission(case_data.step)
    tally = run_verify(get_verifier("rejection"), case_data, emission.rows.tolist(), 2_000, 7)
    assert len(mismatches(emission, tally, 2_000)) >= 2  # both the tokens and the keep rate at row 0


def separation(verdicts: Emission, claimed: Emission) -> float:
    """How much one draw tells a rule whose walk emits ``verdicts`` from the ``claimed`` emission, on
    a chain or at a tree's root: the largest, over the judging rows the check compares, of the
    chi-square noncentrality per draw of the tokens plus that of the keep rate, times the share of
    walks reaching the row (inf where the verdicts emit what the claim rules out)."""
    worst, reach = 0.0, 1.0
    for index in range(len(claimed.rows)):
        if reach * CONDITIONED_SHARE < 1:
            break  # the check compares no later row
        p, claim = verdicts.dist[index].double(), claimed.dist[index].double()
        a, claim_a = float(verdicts.accept[index]), float(claimed.accept[index])
        if bool(((claim == 0) & (p > 0)).any()) or (claim_a in (0.0, 1.0) and a != claim_a):
            return float("inf")
        tokens = float(((p - claim)[claim > 0] ** 2 / claim[claim > 0]).sum())
        keep = 0.0 if claim_a in (0.0, 1.0) else (a - claim_a) ** 2 / (claim_a * (1 - claim_a))
        worst = max(worst, reach * (tokens + keep))
        reach *= a
    return worst


def nearest_settings(case: str) -> tuple[tuple[str, dict], tuple[str, dict], float]:
    """Of the settings the empirical test runs on ``case``, the two whose emissions there differ
    least (by ``separation``, the first one's verdicts against the second's emission)."""
    data = CASES[case]()
    settings = [(name, options) for name, options, each in (param.values for param in empirical_params()) if each == case]
    emissions = {label(*setting): (setting, build(*setting).emission(data.step)) for setting in settings}
    pairs = []
    for (first, one), (second, other) in ((emissions[a], emissions[b]) for a in emissions for b in emissions if a != b):
        distance = separation(one, other)
        if distance > 1e-9:  # equal emissions (two rules that agree on this case) cannot be told apart
            pairs.append((distance, first, second))
    distance, first, second = min(pairs, key=lambda pair: pair[0])
    return first, second, distance


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_the_check_at_its_draw_count_tells_the_nearest_settings_apart(case):
    """Negative control at the empirical test's draw count: on each case, the verdicts of the setting
    whose emission is nearest another's fail the check against that other emission."""
    (name, options), (other, other_options), _ = nearest_settings(case)
    case_data = CASES[case]()
    claimed = build(other, other_options).emission(case_data.step)
    tally = run_verify(build(name, options), case_data, claimed.rows.tolist(), DRAWS, 11)
    assert mismatches(claimed, tally, DRAWS), f"{label(name, options)} passed as {label(other, other_options)} in {DRAWS} draws"


@pytest.mark.parametrize(("name", "options"), configs(lossy=True))
def test_the_lossy_settings_are_lossy_on_the_empirical_cases(name, options):
    """Otherwise the empirical test would compare only the rule's strict branch."""
    verifier = build(name, options)
    for case, make in CASES.items():
        if case == "tree" and verifier.chains_only:
            continue
        case_data = make()
        emission = verifier.emission(case_data.step)
        tv = cost(verifier, case_data.step, emission).tv
        assert float(tv.max()) > 0.02, f"{label(name, options)} emits p itself on the {case} case: TV per row {tv.tolist()}"


# --- greedy ---------------------------------------------------------------------------------

GREEDY_SHAPES = {
    "chain": [-1, 0, 1],
    "root-children": [-1, -1, -1],
    "mixed-tree": [-1, -1, 0, 0, 2],
}


def greedy_step(seed: int, parents: list[int], vocab: int = 6) -> VerifyInput:
    """Logits normal * 2 + 1 (so margin rules fire on some rows); each row's children draw distinct
    tokens from that row's top 3, so drafts are often kept, sometimes by relaxation only."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(parents) + 1, vocab, generator=generator) * 2 + 1
    order = logits.argsort(dim=-1, descending=True, stable=True)
    tokens = [0] * len(parents)
    for row in range(len(parents) + 1):
        children = [node for node, parent in enumerate(parents) if parent + 1 == row]
        picks = torch.randperm(3, generator=generator)[: len(children)]
        for node, pick in zip(children, picks.tolist()):
            tokens[node] = int(order[row, pick])
    probs = 0.5 + 0.5 * torch.rand(len(parents), generator=generator)
    return VerifyInput(torch.tensor(tokens), torch.tensor(parents), logits, SamplingParams(), draft_probs=probs)


def greedy_params() -> list:
    """(name, options, shape): every setting on a chain, those of rules that judge trees on the trees too."""
    return [pytest.param(*param.values, shape, id=f"{param.id}-{shape}")
            for param in configs(LOSSLESS) for shape in GREEDY_SHAPES
            if shape == "chain" or judges_trees(param.values[0])]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "shape"), greedy_params())
def test_greedy_emission_is_one_hot_at_the_emitted_token(name, options, shape):
    """A rule whose greedy verdicts draw a coin (``greedy_draws``: lossy_sd at eps > 0) mixes two point
    masses instead, the argmax and a kept draft off it; what verify emits must be among them."""
    verifier = build(name, options)
    coin = getattr(verifier, "greedy_draws", False)
    parents = GREEDY_SHAPES[shape]
    kept_somewhere = False
    for seed in range(40):
        step = greedy_step(seed, parents)
        emission = verifier.emission(step)
        assert torch.allclose(emission.dist.sum(-1), torch.ones(len(emission.rows))), emission.dist
        if coin:
            assert ((emission.dist > 0).sum(-1) <= 2).all() and ((emission.accept >= 0) & (emission.accept <= 1)).all()
        else:
            assert ((emission.dist == 0) | (emission.dist == 1)).all(), emission.dist
            assert ((emission.accept == 0) | (emission.accept == 1)).all(), emission.accept
        rows = emission.rows.tolist()
        for row, (token, kept) in walk(step, verifier.verify(step)).items():
            if row not in rows:
                continue  # the walk ended on a leaf's row, which judges no draft
            index = rows.index(row)
            if coin:
                assert emission.dist[index, token] > 0, f"seed {seed}, row {row}: emitted {token}, P_V {emission.dist[index]}"
                assert (emission.accept[index] > 0) if kept else (emission.accept[index] < 1), f"seed {seed}, row {row}"
            else:
                emitted = int(emission.dist[index].argmax())
                assert emitted == token, f"seed {seed}, row {row}: verify emitted {token}, emission says {emitted}"
                assert bool(emission.accept[index]) == kept, f"seed {seed}, row {row}: kept={kept}, accept {emission.accept}"
            kept_somewhere |= kept
    assert kept_somewhere  # the check saw kept drafts, not only rejections


# --- properties over random inputs ----------------------------------------------------------

LOGIT = st.one_of(st.floats(-10, 10, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, -1.0]))
SHAPES = [(-1,), (-1, 0), (-1, 0, 1), (-1, -1), (-1, -1, -1), (-1, -1, 0), (-1, 0, 0)]


@st.composite
def random_steps(draw, chains_only: bool = False) -> VerifyInput:
    vocab = draw(st.integers(2, 8))
    shapes = [shape for shape in SHAPES if max(shape.count(parent) for parent in shape) <= vocab]
    parents = list(draw(st.sampled_from([s for s in shapes if not chains_only or s == tuple(range(-1, len(s) - 1))])))
    count = len(parents)
    chain = parents == list(range(-1, count - 1))
    logits = torch.tensor([[draw(LOGIT) for _ in range(vocab)] for _ in range(count + 1)], dtype=torch.float32)
    sampling = SamplingParams(
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 2])),
        top_p=draw(st.sampled_from([1.0, 0.8])),
    )
    tokens = [0] * count
    for row in range(count + 1):
        children = [node for node, parent in enumerate(parents) if parent + 1 == row]
        distinct = draw(st.permutations(range(vocab)))
        for node, token in zip(children, distinct):
            tokens[node] = token
    dists = None
    if chain and draw(st.booleans()):
        weight = st.one_of(st.just(0.0), st.floats(0, 1, width=32))  # zeros: q with a partial support
        raw = torch.tensor([[draw(weight) for _ in range(vocab)] for _ in range(count)])
        raw[raw.sum(-1) == 0] = 1.0
        dists = raw / raw.sum(-1, keepdim=True)
        tokens = [draw(st.sampled_from(torch.nonzero(dists[node] > 0).flatten().tolist())) for node in range(count)]
        probs = dists[torch.arange(count), torch.tensor(tokens)]
    else:
        probs = torch.tensor([draw(st.floats(0.001, 1)) for _ in range(count)])
    if draw(st.booleans()):
        probs = None
    return VerifyInput(torch.tensor(tokens), torch.tensor(parents), logits, sampling, draft_probs=probs, draft_dists=dists)


def is_chain(step: VerifyInput) -> bool:
    return step.parents.tolist() == list(range(-1, step.num_drafts - 1))


def refuses_trees(verifier) -> bool:
    """Whether the verifier judges chains only (``emission`` and ``verify`` both refuse a tree)."""
    tree = VerifyInput(torch.tensor([0, 1]), torch.tensor([-1, -1]), torch.zeros(3, 2), SAMPLE)
    try:
        verifier.emission(tree)
    except ValueError:
        with pytest.raises(ValueError):
            verifier.verify(tree, generator=torch.Generator().manual_seed(0))
        return True
    return False


def check_is_a_distribution(step: VerifyInput, emission: Emission) -> None:
    vocab = step.target_logits.shape[-1]
    judging = sorted({parent + 1 for parent in step.parents.tolist()})
    assert emission.rows.tolist() == judging
    assert emission.dist.shape == (len(judging), vocab) and emission.accept.shape == (len(judging),)
    assert torch.isfinite(emission.dist).all() and (emission.dist >= 0).all(), emission.dist
    assert torch.allclose(emission.dist.double().sum(-1), torch.ones(len(judging), dtype=torch.float64), atol=1e-5), emission.dist
    assert ((emission.accept >= 0) & (emission.accept <= 1 + 1e-6)).all(), emission.accept  # float32 sums


PROPERTY_EXAMPLES = property_examples(found=50, stress=200)  # on both cores
DEFAULTS = [(name, {}) for name in available_verifiers()]


@pytest.mark.parametrize(("name", "options"), configs([*LOSSLESS, ("mars_ref", {"theta": None}), *DEFAULTS]))
@pytest.mark.slow
def test_every_emission_is_a_distribution_and_no_rule_beats_the_acceptance_bound(name, options):
    verifier = build(name, options)

    @given(step=random_steps(chains_only=refuses_trees(verifier)))
    def check(step):
        emission = verifier.emission(step)
        check_is_a_distribution(step, emission)
        if is_chain(step):
            measured = cost(verifier, step, emission)
            bound = 1.0 - measured.draft_tv + measured.tv + 1e-6
            # Given that the walk reached a later row, fly's draft there is not distributed as q: row 0 alone.
            within = (measured.accept <= bound)[: 1 if getattr(verifier, "emission_given_drafts", False) else None]
            assert within.all(), f"alpha_V {measured.accept.tolist()} above the bound {bound.tolist()}"
            if step.draft_dists is not None:  # P_V marginalises over the drafts: other draws give the same
                assert marginal_over_drafts(verifier, step, emission, step.draft_dists.argmax(-1))

    examples_on_every_core(check, PROPERTY_EXAMPLES)


@pytest.mark.parametrize(
    ("name", "options"), [pytest.param(name, options, id=label(name, options)) for name, options in LOSSLESS]
)
@pytest.mark.slow
def test_the_lossless_rules_emit_p_itself(name, options):
    verifier = build(name, options)

    @given(step=random_steps())
    def check(step):
        measured = cost(verifier, step, verifier.emission(step))
        assert (measured.tv < 1e-6).all(), measured.tv
        assert (measured.kl < 1e-6).all(), measured.kl

    examples_on_every_core(check, PROPERTY_EXAMPLES)


@pytest.mark.parametrize("eps", [0.1, 0.3])
@pytest.mark.slow
def test_tv_budget_spends_exactly_its_budget(eps):
    verifier = build("tv_budget", {"eps": eps})

    @given(step=random_steps(chains_only=True))
    def check(step):
        measured = cost(verifier, step, verifier.emission(step))
        expected_accept = (1.0 - measured.draft_tv + eps).clamp(max=1.0)
        assert torch.allclose(measured.accept, expected_accept, atol=1e-6), (measured.accept, expected_accept)
        expected_tv = measured.draft_tv.clamp(max=eps)
        assert torch.allclose(measured.tv, expected_tv, atol=1e-6), (measured.tv, expected_tv)

    examples_on_every_core(check, PROPERTY_EXAMPLES)


def kl_divergence(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """KL(first || second) per row, in float64 (+inf where first has mass second rules out)."""
    first, second = first.double(), second.double()
    terms = first * (torch.log(first.clamp(min=1e-300)) - torch.log(second))
    return torch.where(first > 0, terms, torch.zeros_like(terms)).sum(-1)


@pytest.mark.parametrize("budget", [0.05, 0.2])
@pytest.mark.slow
def test_mentored_stays_within_its_kl_budget(budget):
    """KL(P_V || p) <= D, and P_V = q where q itself is within the budget (for drafts the target
    nearly rules out see the test that follows)."""
    verifier = build("mentored", {"kl_budget": budget})

    @given(step=random_steps(chains_only=True))
    def check(step):
        emission = verifier.emission(step)
        q = proposal_rows(step.draft_tokens, step.draft_dists, step.target_logits.shape[-1]).double()
        p = target_probs(verifier, step)[emission.rows].double()
        kl = kl_divergence(emission.dist, p)
        assert (kl <= budget + 1e-6).all(), (kl, budget)
        within = kl_divergence(q, p) <= budget - 1e-6
        assert torch.allclose(emission.dist.double()[within], q[within], atol=1e-5), (emission.dist, q)

    examples_on_every_core(check, PROPERTY_EXAMPLES)


@pytest.mark.parametrize("budget", [0.05, 0.2])
def test_mentored_stays_within_its_kl_budget_for_a_nearly_impossible_draft(budget):
    # p at the draft (token 0) is e^-36 / Z ~ 2.3e-16; q is one-hot there. The p mass clipped at hi
    # is then 2.3e-16, which a difference of two sums near 1 would lose.
    logits = torch.tensor([[-10.0, 0.0, 0.0, 0.0, 8.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    step = VerifyInput(torch.tensor([0]), torch.tensor([-1]), logits, SamplingParams(temperature=0.5))
    verifier = build("mentored", {"kl_budget": budget})
    emission = verifier.emission(step)
    kl = float(kl_divergence(emission.dist, target_probs(verifier, step)[emission.rows])[0])
    assert kl <= budget + 1e-6, f"KL(P_V || p) = {kl:.6f} > D = {budget}"


def test_every_registered_verifier_has_lossy_settings_here():
    assert set(available_verifiers()) == set(LOSSY), "add settings under which the new verifier's relaxation fires"


@pytest.mark.parametrize("name", [name for name in available_verifiers() if not judges_trees(name)])
def test_a_chains_only_rule_refuses_a_tree_in_verify_and_in_emission(name):
    verifier = get_verifier(name)
    for step in (root_tree().step, greedy_step(0, GREEDY_SHAPES["mixed-tree"])):  # sampled, greedy
        with pytest.raises(ValueError, match=f"^verifier {name} judges chains only"):
            verifier.emission(step)
        with pytest.raises(ValueError, match=f"^verifier {name} judges chains only"):
            verifier.verify(step)
