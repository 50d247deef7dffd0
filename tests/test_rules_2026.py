"""The rules of 2025-26 that the zoo lacked: SGLang's acceptance thresholds (``threshold``), fuzzy
speculative decoding (``fsd``), SecureSD's eps-additive LossySD (``lossy_sd``) and BiLD's rollback
(``bild``). Each is held to a case worked out by hand from its own definition, to ``rejection``
(``exact`` in greedy mode) at its lossless setting, verdicts under the same generator and P_V, and to
refusing a bad setting in one line. The match of each rule's P_V with its sampled verdicts, and the
registry-wide properties, are in test_emission.py and test_verifier_properties.py."""

from __future__ import annotations

import math

import pytest
import torch

from mars_bench.verification import VerifyInput, batch_steps, get_verifier
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

SAMPLE = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()
P = [0.5, 0.3, 0.15, 0.05]  # the target's p at every row of the hand cases (logits log p)
Q = [0.1, 0.6, 0.2, 0.1]


def step(tokens: list[int], parents: list[int], rows: list[list[float]], sampling=SAMPLE, dists=None) -> VerifyInput:
    """Drafts ``tokens`` with target logits log ``rows`` (so p is ``rows``), and the drafter's ``dists`` if given."""
    logits = torch.log(torch.tensor(rows))
    draft_dists = None if dists is None else torch.tensor(dists)
    return VerifyInput(torch.tensor(tokens), torch.tensor(parents), logits, sampling, draft_dists=draft_dists)


def coins(seed: int, count: int) -> list[float]:
    """The float32 uniforms a step of ``count`` drafts draws first from a generator seeded ``seed``."""
    return torch.rand(count, generator=torch.Generator().manual_seed(seed)).tolist()


def judge(verifier, data: VerifyInput, seed: int):
    return verifier.verify(data, generator=torch.Generator().manual_seed(seed))


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)


# --- by hand ------------------------------------------------------------------------------------


def test_threshold_keeps_a_chain_draft_on_its_target_probability_alone():
    verifier = get_verifier("threshold", threshold_single=0.4, threshold_acc=0.5)
    runner_up = step([1], [-1], [P, P])
    a = 0.3 / 0.5  # p(x) < t_s: kept when u < p(x) / t_a; a reject draws from p without x
    emission = verifier.emission(runner_up)
    close(emission.dist[0], [(1 - a) * 0.5 / 0.7, a, (1 - a) * 0.15 / 0.7, (1 - a) * 0.05 / 0.7])
    close(emission.accept, [a])
    for seed in range(20):
        verdict = judge(verifier, runner_up, seed)
        assert verdict.accepted_len == (coins(seed, 1)[0] < a), seed
        assert verdict.accepted_len or verdict.next_token != 1
    top = step([0], [-1], [P, P])  # p(x) = 0.5 >= t_s: kept whatever the coin
    assert all(judge(verifier, top, seed).accepted_len == 1 for seed in range(10))
    # q is never read: with the drafter's q, P_V(y) = sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) p(y) 1{y != x} / (1 - p(x))]
    keep = [1.0 if p >= 0.4 else p / 0.5 for p in P]
    expected = [sum(q * (keep[x] * (y == x) + (1 - keep[x]) * P[y] * (y != x) / (1 - P[x])) for x, q in enumerate(Q))
                for y in range(4)]  # fmt: skip
    close(verifier.emission(step([1], [-1], [P, P], dists=[Q])).dist[0], expected)


def test_threshold_siblings_share_one_coin_against_their_cumulative_mass():
    tree = step([2, 1], [-1, -1], [P, P, P])
    verifier = get_verifier("threshold", threshold_acc=0.5)
    # S_1 = 0.15, S_2 = 0.45: node 0 on u < 0.3, node 1 on 0.3 <= u < 0.9, neither on u >= 0.9, then p without tokens 1, 2
    emission = verifier.emission(tree)
    close(emission.dist[0], [0.1 * 0.5 / 0.55, 0.6, 0.3, 0.1 * 0.05 / 0.55])
    close(emission.accept, [0.9])
    for seed in range(30):
        coin = coins(seed, 2)[0]
        verdict = judge(verifier, tree, seed)
        assert verdict.accepted.tolist() == ([0] if coin < 0.3 else [1] if coin < 0.9 else []), (seed, coin)
        assert verdict.accepted_len or verdict.next_token in (0, 3)
    single = get_verifier("threshold", threshold_single=0.25, threshold_acc=0.5).emission(tree)
    close(single.dist[0], [0.0, 0.7, 0.3, 0.0])  # p(token 1) = 0.3 >= t_s: kept whenever node 0 is not


JS_SAMPLED = 0.75 * math.log(1.5) - 0.25 * math.log(2.0)  # p = (0.75, 0.25), q = (0.25, 0.75): m = (0.5, 0.5)
JS_ONE_HOT = 0.5 * (0.75 * math.log(2.0) + 0.25 * math.log(0.4) + math.log(1.6))  # q one-hot at token 1: m = (0.375, 0.625)


@pytest.mark.parametrize(
    ("kind", "sampled", "one_hot"),
    [("tv", 0.5, 0.75), ("kl", 0.5 * math.log(3.0), math.log(4.0)), ("js", JS_SAMPLED, JS_ONE_HOT)],
)
def test_fsd_keeps_the_draft_exactly_where_the_divergence_is_within_the_threshold(kind, sampled, one_hot):
    p, q = [0.75, 0.25], [0.25, 0.75]
    for data, value in ((step([1], [-1], [p, p], dists=[q]), sampled), (step([1], [-1], [p, p]), one_hot)):
        proposal = q if data.draft_dists is not None else [0.0, 1.0]
        strict_alpha = sum(min(a, b) for a, b in zip(p, proposal))
        for threshold, within in ((value + 0.01, True), (value - 0.01, False)):
            for residual in ("target", "strict"):
                verifier = get_verifier("fsd", divergence=kind, threshold=threshold, residual=residual)
                emission = verifier.emission(data)
                close(emission.dist[0], proposal if within else p)
                close(emission.accept, [1.0 if within else 0.0 if residual == "target" else strict_alpha])
                if within or residual == "target":  # the verdict is the divergence test's alone
                    assert all(judge(verifier, data, seed).accepted_len == within for seed in range(5))


def test_fsd_in_greedy_mode_measures_point_masses():
    runner_up = step([1], [-1], [P, P], GREEDY)
    for kind, apart in (("js", math.log(2.0)), ("tv", 1.0)):
        assert get_verifier("fsd", divergence=kind, threshold=apart + 1e-3).verify(runner_up).accepted_len == 1
        assert get_verifier("fsd", divergence=kind, threshold=apart - 1e-3).verify(runner_up).accepted_len == 0
    assert get_verifier("fsd", divergence="kl", threshold=1e6).verify(runner_up).accepted_len == 0
    assert get_verifier("fsd", threshold=0.0).verify(step([0], [-1], [P, P], GREEDY)).accepted_len == 1  # the argmax: D = 0


def test_lossy_sd_adds_eps_to_the_strict_ratio():
    verifier = get_verifier("lossy_sd", eps=0.2)
    # a = min(1, p / q + 0.2) = (1, 0.7, 0.95, 0.7), alpha = 0.78; the residual max(0, p - q) is all on token 0
    emission = verifier.emission(step([1], [-1], [P, P], dists=[Q]))
    close(emission.dist[0], [0.1 + 0.22, 0.42, 0.19, 0.07])
    close(emission.accept, [0.78])
    deterministic = step([3], [-1], [P, P])  # q one-hot: kept with min(1, 0.05 + 0.2); a reject draws p without token 3
    close(verifier.emission(deterministic).dist[0], [0.75 * 0.5 / 0.95, 0.75 * 0.3 / 0.95, 0.75 * 0.15 / 0.95, 0.25])
    for seed in range(20):
        assert judge(verifier, deterministic, seed).accepted_len == (coins(seed, 1)[0] < 0.25), seed


def test_lossy_sd_in_greedy_mode_keeps_a_draft_off_the_argmax_on_a_coin_of_eps():
    verifier = get_verifier("lossy_sd", eps=0.3)
    chain = step([3, 0], [-1, 0], [P, P, P], GREEDY)  # token 3 off the argmax, then the argmax 0
    emission = verifier.emission(chain)
    close(emission.dist, [[0.7, 0.0, 0.0, 0.3], [1.0, 0.0, 0.0, 0.0]])
    close(emission.accept, [0.3, 1.0])
    for seed in range(20):
        verdict = judge(verifier, chain, seed)
        assert verdict.accepted.tolist() == ([0, 1] if coins(seed, 2)[0] < 0.3 else []), seed
        assert verdict.next_token == 0
    one = step([3], [-1], [P, P], GREEDY)
    draws = 4_000
    verdicts = verifier.verify_batch(batch_steps([one] * draws), generator=torch.Generator().manual_seed(1))
    kept = sum(verdict.accepted_len for verdict in verdicts)
    assert abs(kept - 0.3 * draws) < 4 * math.sqrt(draws * 0.3 * 0.7), kept
    generator = torch.Generator().manual_seed(2)
    state = generator.get_state()
    get_verifier("lossy_sd", eps=0.0).verify(one, generator=generator)
    assert torch.equal(generator.get_state(), state)  # eps = 0 draws no coin


def test_bild_keeps_plausible_drafts_outright_and_judges_the_rest_strictly():
    verifier = get_verifier("bild", rollback=2.0)  # e^-2 = 0.135: tokens 0, 1, 2 are plausible, token 3 (-log 0.05 = 3.0) not
    # a = (1, 1, 1, min(1, 0.05 / 0.1)), alpha = 0.95; the residual max(0, p - q) is all on token 0
    emission = verifier.emission(step([1], [-1], [P, P], dists=[Q]))
    close(emission.dist[0], [0.1 + 0.05, 0.6, 0.2, 0.05])
    close(emission.accept, [0.95])
    close(verifier.emission(step([3], [-1], [P, P])).dist[0], P)  # judged strictly: p itself
    close(verifier.emission(step([2], [-1], [P, P])).accept, [1.0])
    rejected = verifier.verify(step([3], [-1], [P, P], GREEDY))
    assert (rejected.accepted_len, rejected.next_token) == (0, 0)  # -log p > r off the argmax: roll back to the argmax
    assert verifier.verify(step([2], [-1], [P, P], GREEDY)).accepted_len == 1
    assert get_verifier("bild", rollback=3.1).verify(step([3], [-1], [P, P], GREEDY)).accepted_len == 1


# --- the lossless settings ----------------------------------------------------------------------

LOSSLESS = [
    ("threshold", {}),
    ("fsd", {"threshold": 0.0, "residual": "strict"}),
    ("lossy_sd", {"eps": 0.0}),
    ("bild", {"rollback": 0.0}),
]


def chain(seed: int, sampled: bool, temperature: float = 1.0, drafts: int = 3, vocab: int = 7) -> VerifyInput:
    """Drafts from a q near the target's p (so some are kept), with q given (``sampled``) or not."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(drafts + 1, vocab, generator=generator) * 2
    dists = torch.softmax(logits[:drafts] + torch.randn(drafts, vocab, generator=generator), dim=-1)
    tokens = torch.multinomial(dists, 1, generator=generator).flatten()
    return VerifyInput(tokens, torch.arange(-1, drafts - 1), logits, SamplingParams(temperature),
                       draft_dists=dists if sampled else None)  # fmt: skip


def outcome(verdict) -> tuple:
    return verdict.accepted.tolist(), verdict.next_token, verdict.decisions.reasons.tolist()


@pytest.mark.parametrize(("name", "options"), LOSSLESS)
@pytest.mark.parametrize("sampled", [True, False])
def test_at_its_lossless_setting_each_rule_is_rejection(name, options, sampled):
    ours, strict = get_verifier(name, **options), get_verifier("rejection")
    for seed in range(10):
        data = chain(seed, sampled)
        p = probabilities(process_logits(data.target_logits, data.sampling), data.sampling)[: data.num_drafts]
        close(ours.emission(data).dist, p.tolist())
        close(strict.emission(data).dist, p.tolist())
        if name == "threshold" and sampled:
            continue  # rejection reads the drafter's q, threshold never does: the same P_V, not the same draws
        for draw in range(3):
            assert outcome(judge(ours, data, draw)) == outcome(judge(strict, data, draw)), (seed, draw)


def test_threshold_at_one_and_one_emits_p_on_a_tree():
    tree = [-1, -1, 0, 0, 1]
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits = torch.randn(len(tree) + 1, 6, generator=generator) * 2
        tokens = torch.cat([torch.randperm(6, generator=generator)[:2], torch.randperm(6, generator=generator)[:2],
                            torch.randperm(6, generator=generator)[:1]])  # fmt: skip
        data = VerifyInput(tokens, torch.tensor(tree), logits, SAMPLE)
        emission = get_verifier("threshold").emission(data)
        p = probabilities(process_logits(logits, SAMPLE), SAMPLE)[emission.rows]
        close(emission.dist, p.tolist())
        close(get_verifier("rejection").emission(data).dist, p.tolist())


def test_fsd_at_threshold_zero_emits_p_when_it_rejects_outright():
    for seed in range(10):
        data = chain(seed, sampled=True)
        p = probabilities(process_logits(data.target_logits, SAMPLE), SAMPLE)[: data.num_drafts]
        close(get_verifier("fsd", threshold=0.0).emission(data).dist, p.tolist())


@pytest.mark.parametrize(("name", "options"), [*LOSSLESS, ("threshold", {"threshold_single": 0.3, "threshold_acc": 0.5})])
def test_in_greedy_mode_at_its_lossless_setting_each_rule_is_exact(name, options):
    """``threshold`` is ``exact`` in greedy mode whatever its settings. No lossless setting draws a coin."""
    ours, exact = get_verifier(name, **options), get_verifier("exact")
    kept = 0
    for seed in range(15):
        data = chain(seed, sampled=False, temperature=0.0)
        generator = torch.Generator().manual_seed(seed)
        state = generator.get_state()
        mine = ours.verify(data, generator=generator)
        assert outcome(mine) == outcome(exact.verify(data)), seed
        assert torch.equal(generator.get_state(), state)
        kept += mine.accepted_len
    assert kept > 0  # the drafts matched the argmax somewhere


# --- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        ("threshold", {"threshold_single": 0.0}, r"threshold_single=0.0 is invalid: allowed is a number in \(0, 1\]"),
        ("threshold", {"threshold_acc": 1.5}, r"threshold_acc=1.5 is invalid: allowed is a number in \(0, 1\]"),
        ("threshold", {"threshold": 0.5}, "verifier threshold has no setting 'threshold': allowed are threshold_single"),
        ("fsd", {"divergence": "hellinger"}, "divergence='hellinger' is invalid: allowed are js, kl, tv"),
        ("fsd", {"threshold": -0.1}, "threshold=-0.1 is invalid: allowed is a finite number >= 0"),
        ("fsd", {"threshold": math.inf}, "threshold=inf is invalid"),
        ("fsd", {"residual": "p"}, "residual='p' is invalid: allowed are target, strict"),
        ("lossy_sd", {"eps": -0.1}, r"eps=-0.1 is invalid: allowed is a number in \[0, 1\]"),
        ("lossy_sd", {"eps": True}, "eps=True is invalid"),
        ("bild", {"rollback": -1}, "rollback=-1 is invalid: allowed is a finite number >= 0"),
        ("bild", {"rollback": math.nan}, "rollback=nan is invalid"),
    ],
)
def test_a_bad_setting_is_refused_in_one_line(name, settings, message):
    with pytest.raises(ValueError, match=message) as info:
        get_verifier(name, **settings)
    assert "\n" not in str(info.value)


def test_the_defaults_and_what_records_carry():
    described = {
        "threshold": {"threshold_single": 1.0, "threshold_acc": 1.0},
        "fsd": {"divergence": "js", "threshold": 0.2, "residual": "target"},
        "lossy_sd": {"eps": 0.1},
        "bild": {"rollback": 8.0},
    }
    for name, settings in described.items():
        verifier = get_verifier(name)
        assert verifier.describe() == {"name": name, **settings}
        assert not verifier.lossless and not any(statistic.name == "trigger" for statistic in verifier.statistics)
        assert verifier.chains_only == (name != "threshold")
