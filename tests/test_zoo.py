"""The lossy verifier zoo: each rule's defining property, its reduction to the strict rule at its
lossless setting (``rejection`` when sampling, ``exact`` when greedy), and how runs name, check and
record them. The match between each rule's exact P_V and its real verdicts is in test_emission.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import run_config, tiny_model

from mars_bench.common.settings import parse_label, plugin_label
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import shadow_verifiers
from mars_bench.decoding.engine import decode
from mars_bench.decoding.fidelity import expected_accepted
from mars_bench.drafting import build_drafter
from mars_bench.verification import VerifyInput, get_verifier
from mars_bench.verification.emission import fidelity, proposal_rows
from mars_bench.verification.mentored import ClippedTarget
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

LOSSLESS = {  # each rule at its lossless setting
    "top_m": {"m": 0},
    "lenient": {"lenience": 1.0},
    "cascade": [{"rule": "chow", "alpha": 0.0}, {"rule": "opt", "alpha": -1.0}],
    "mentored": {"kl_budget": 0.0},
    "tv_budget": {"eps": 0.0},
}


def settings_of(name: str) -> list[dict]:
    found = LOSSLESS[name]
    return found if isinstance(found, list) else [found]


def chain_step(seed: int, vocab: int = 7, drafts: int = 3, temperature: float = 1.0, sampled: bool = True) -> VerifyInput:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(drafts + 1, vocab, generator=generator) * 2
    dists = torch.softmax(torch.randn(drafts, vocab, generator=generator) * 2, dim=-1)
    tokens = torch.multinomial(dists, 1, generator=generator).flatten()
    return VerifyInput(
        draft_tokens=tokens,
        parents=torch.arange(-1, drafts - 1),
        target_logits=logits,
        sampling=SamplingParams(temperature),
        draft_probs=dists.gather(-1, tokens[:, None]).flatten(),
        draft_dists=dists if sampled and temperature > 0 else None,
    )


def target_and_proposal(step: VerifyInput) -> tuple[torch.Tensor, None, torch.Tensor]:
    p = probabilities(process_logits(step.target_logits, step.sampling), step.sampling)[: step.num_drafts]
    return p, None, proposal_rows(step.draft_tokens, step.draft_dists, p.shape[-1])


def costs(name: str, step: VerifyInput, **settings):
    p, _, q = target_and_proposal(step)
    return fidelity(get_verifier(name, **settings).emission(step), p, q)


@pytest.mark.parametrize("name", sorted(LOSSLESS))
@pytest.mark.parametrize("sampled", [True, False])
def test_at_its_lossless_setting_each_rule_is_the_strict_rule(name, sampled):
    for settings in settings_of(name):
        for seed in range(20):
            step = chain_step(seed, sampled=sampled)
            ours, strict = get_verifier(name, **settings), get_verifier("rejection")
            assert torch.allclose(ours.emission(step).dist, strict.emission(step).dist, atol=1e-6)
            for draw in range(5):
                mine = ours.verify(step, generator=torch.Generator().manual_seed(draw))
                theirs = strict.verify(step, generator=torch.Generator().manual_seed(draw))
                assert (mine.accepted.tolist(), mine.next_token) == (theirs.accepted.tolist(), theirs.next_token)


@pytest.mark.parametrize("name", sorted(LOSSLESS))
def test_in_greedy_mode_at_its_lossless_setting_each_rule_is_exact(name):
    for settings in settings_of(name):
        for seed in range(30):
            step = chain_step(seed, temperature=0.0)
            mine = get_verifier(name, **settings).verify(step)
            exact = get_verifier("exact").verify(step)
            assert (mine.accepted.tolist(), mine.next_token) == (exact.accepted.tolist(), exact.next_token)


def test_top_m_keeps_every_draft_among_the_targets_top_m_and_judges_the_rest_strictly():
    for seed in range(20):
        step = chain_step(seed)
        p, _, q = target_and_proposal(step)
        in_top = torch.zeros_like(p, dtype=torch.bool).scatter(-1, torch.topk(p, 3, dim=-1).indices, True)
        keep = torch.where(in_top, 1.0, (p / q).clamp(max=1.0))
        assert torch.allclose(get_verifier("top_m", m=3).emission(step).accept, (q * keep).sum(-1), atol=1e-6)
    for seed in range(5):  # greedy: a draft among the top m is kept outright
        step = chain_step(seed, temperature=0.0)
        top = torch.topk(step.target_logits[0], 3).indices
        kept = get_verifier("top_m", m=3).verify(step).accepted_len > 0
        assert kept == bool((top == step.draft_tokens[0]).any())


def test_lenient_accepts_sum_of_min_q_and_p_over_l():
    for seed in range(20):
        step = chain_step(seed)
        p, _, q = target_and_proposal(step)
        alpha = get_verifier("lenient", lenience=0.25).emission(step).accept
        assert torch.allclose(alpha, torch.minimum(q, p / 0.25).sum(-1).clamp(max=1.0), atol=1e-6)


def test_cascade_emits_the_drafter_where_its_deferral_rule_keeps_it_and_the_target_elsewhere():
    for rule, alpha in (("chow", 0.5), ("opt", 0.5)):
        kept = 0
        for seed in range(20):
            step = chain_step(seed)
            p, _, q = target_and_proposal(step)
            confidence, distance = q.max(-1).values, 0.5 * (p - q).abs().sum(-1)
            keep = confidence > (1 - alpha if rule == "chow" else p.max(-1).values - alpha * distance)
            dist = get_verifier("cascade", rule=rule, alpha=alpha).emission(step).dist
            assert torch.allclose(dist, torch.where(keep[:, None], q, p), atol=1e-6)
            kept += int(keep.sum())
        assert kept > 0, rule  # the rule did keep the drafter somewhere


def test_mentoreds_lower_constant_makes_its_target_sum_to_one_exactly():
    """lo is solved on the mass's linear segment: for random p, q (zeros on either side included) and
    hi >= 1, pi sums to 1 to rounding, and lo agrees with a 60-step bisection of the mass."""
    generator = torch.Generator().manual_seed(5)
    for trial in range(40):
        vocab = 2 + trial % 9
        p = torch.softmax(torch.randn(3, vocab, generator=generator, dtype=torch.float64) * 3, -1)
        q = torch.softmax(torch.randn(3, vocab, generator=generator, dtype=torch.float64) * 3, -1)
        if trial % 3 == 0:  # tokens the target rules out (q / p = inf) and tokens neither proposes
            p[:, : vocab // 3] = 0.0
            q[:, -1] = 0.0
            p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        clipped = ClippedTarget(p, q)
        hi = torch.exp(torch.rand(3, generator=generator, dtype=torch.float64) * 4)
        lo = clipped.lower_for(hi)
        assert ((lo >= 0) & (lo <= 1)).all()
        assert torch.allclose(clipped.mass(lo, hi), torch.ones(3, dtype=torch.float64), atol=1e-12), trial
        low, high = torch.zeros_like(hi), torch.ones_like(hi)
        for _ in range(60):
            middle = 0.5 * (low + high)
            short = clipped.mass(middle, hi) < 1.0
            low, high = torch.where(short, middle, low), torch.where(short, high, middle)
        assert torch.allclose(lo, high, atol=1e-12), trial


@pytest.mark.slow
def test_mentored_stays_within_its_kl_budget_and_beats_every_other_rule_that_does():
    others = [("tv_budget", {"eps": eps}) for eps in (0.02, 0.05, 0.1)] + [("lenient", {"lenience": 0.8}),
              ("top_m", {"m": 2}), ("mars", {"theta": 0.7}), ("cascade", {"rule": "opt", "alpha": 0.3})]  # fmt: skip
    budget, compared = 0.05, 0
    for seed in range(20):
        step = chain_step(seed)
        mentored = costs("mentored", step, kl_budget=budget)
        p, _, q = target_and_proposal(step)
        reachable = (q * (torch.log(q) - torch.log(p))).sum(-1)  # KL(q || p): emitting q costs this much
        assert (mentored.kl <= budget + 1e-6).all()
        assert torch.allclose(mentored.kl, reachable.clamp(max=budget), atol=1e-5)
        for name, settings in others:
            other = costs(name, step, **settings)
            within = other.kl <= budget
            assert (mentored.accept[within] >= other.accept[within] - 1e-5).all(), (name, seed)
            compared += int(within.sum())
    assert compared > 50


def test_tv_budget_moves_eps_of_mass_and_reaches_the_bound():
    for seed in range(20):
        step = chain_step(seed)
        measured = costs("tv_budget", step, eps=0.1)
        assert torch.allclose(measured.tv, measured.draft_tv.clamp(max=0.1), atol=1e-6)
        assert torch.allclose(measured.accept, (1 - measured.draft_tv + 0.1).clamp(max=1.0), atol=1e-6)


def test_the_entropy_gate_relaxes_only_above_its_entropy():
    for seed in range(20):
        step = chain_step(seed)
        p, _, _ = target_and_proposal(step)
        entropy = -(p * torch.log(p)).sum(-1)
        gate = float(entropy.median())
        gated = get_verifier("mars", theta=0.3, entropy_gate=gate).emission(step).dist
        plain = get_verifier("mars", theta=0.3).emission(step).dist
        strict = get_verifier("rejection").emission(step).dist
        high = entropy > gate
        assert torch.allclose(gated[high], plain[high]) and torch.allclose(gated[~high], strict[~high])
    never = get_verifier("mars", theta=0.3, entropy_gate=100.0)
    assert torch.allclose(never.emission(step).dist, strict)


def test_zoo_rules_refuse_a_tree_in_one_line():
    step = chain_step(0, sampled=False)
    tree = VerifyInput(step.draft_tokens, torch.tensor([-1, -1, 0]), step.target_logits, step.sampling, step.draft_probs)
    for name in LOSSLESS:
        with pytest.raises(ValueError, match=f"^verifier {name} judges chains only: got a tree of drafts"):
            get_verifier(name).verify(tree)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"m": -1}, "m=-1 is invalid"),
        ({"lenience": 0.0}, r"lenience=0.0 is invalid: allowed is a number in \(0, 1\]"),
        ({"rule": "cheap"}, "rule='cheap' is invalid: allowed are chow, opt"),
        ({"rule": "chow", "alpha": -0.5}, r"alpha=-0.5 is invalid: allowed is a number in \[0, 1\] for rule=chow"),
        ({"rule": "opt", "alpha": -2}, "alpha=-2 is invalid: allowed is a finite number >= -1 for rule=opt"),
        ({"kl_budget": -1}, "kl_budget=-1 is invalid"),
        ({"eps": 1.5}, r"eps=1.5 is invalid: allowed is a number in \[0, 1\]"),
        ({"entropy_gate": -1.0}, "entropy_gate=-1.0 is invalid"),
    ],
)
def test_bad_zoo_settings_fail_with_one_line_naming_the_value(settings, message):
    name = {"m": "top_m", "lenience": "lenient", "rule": "cascade", "kl_budget": "mentored", "eps": "tv_budget",
            "entropy_gate": "mars"}[next(iter(settings))]  # fmt: skip
    with pytest.raises(ValueError, match=message) as info:
        get_verifier(name, **settings)
    assert "\n" not in str(info.value)


def test_a_shadow_spec_sets_its_own_settings_and_labels_them():
    cfg = run_config("verifier=rejection", 'shadow=["mars(theta=0.8)",rejection,"tv_budget(eps=0.05)"]')
    shadows = shadow_verifiers(cfg)
    assert list(shadows) == ["mars(theta=0.8,guard=never,correction=residual)", "rejection", "tv_budget(eps=0.05)"]
    assert shadows["tv_budget(eps=0.05)"].params.eps == 0.05
    for label, verifier in shadows.items():
        assert plugin_label(verifier.name, verifier.params) == label and parse_label(label)[0] == verifier.name
    assert parse_label("mars(theta=None,guard=gap)") == ("mars", {"theta": None, "guard": "gap"})


@pytest.mark.parametrize(
    ("shadow", "message"),
    [
        ('shadow=["mars(thet=0.8)"]', r"shadow 'mars\(thet=0.8\)': verifier mars has no setting 'thet': allowed are"),
        ('shadow=["tv_budget(eps=2)"]', r"shadow 'tv_budget\(eps=2\)': eps=2 is invalid"),
        ('shadow=["mars(theta=0.8"]', "is not a plugin label"),
        ('shadow=["mars(theta=0.8)","mars(theta=0.8,guard=never)"]', "repeats mars"),
    ],
)
def test_a_bad_shadow_spec_is_refused_in_one_line(shadow, message):
    with pytest.raises(ValueError, match=message) as info:
        check_run_config(run_config(shadow))
    assert "\n" not in str(info.value)


def test_a_tree_drafter_with_a_chain_only_verifier_is_refused_before_any_model_loads():
    with pytest.raises(ValueError, match="drafter=model_tree drafts trees, which top_m.* cannot judge"):
        check_run_config(run_config("drafter=model_tree", 'shadow=["top_m(m=2)"]'))
    check_run_config(run_config("experiment=decomposition", "+decomposition=4_both"))
    check_run_config(run_config("experiment=zoo"))


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama", seed=0), build_drafter("model", model=tiny_model("llama", seed=7, layers=2), vocab_size=96)


SHADOWS = ["mars(theta=0.5)", "tv_budget(eps=0.1)", "mentored(kl_budget=0.05)"]


@pytest.mark.slow
def test_fidelity_changes_nothing_the_run_emits_and_a_lossless_live_rule_costs_nothing(pair):
    target, drafter = pair
    shadows = [get_verifier(*parse_label(spec)[:1], **parse_label(spec)[1]) for spec in SHADOWS]
    kwargs = dict(max_new_tokens=40, temperature=1.0, seed=4, gamma=4, shadow=shadows)
    plain = decode(target, drafter, "rejection", [1, 5, 9, 13], **kwargs)
    measured = decode(target, drafter, "rejection", [1, 5, 9, 13], fidelity=True, **kwargs)
    assert measured.tokens == plain.tokens
    assert [step.shadow_accepted for step in measured.steps] == [step.shadow_accepted for step in plain.steps]
    live, mars, tv_budget, mentored = measured.fidelity()
    drafted = [step for step in measured.steps if step.drafted]
    assert live["positions"] == sum(step.drafted for step in drafted) and live["steps"] == len(drafted)
    assert live["judged"] == sum(len(step.reasons) for step in drafted)
    assert live["kl"] < 1e-6 and live["tv"] < 1e-6 * live["positions"]
    assert mars["accept"] > live["accept"] and mars["kl"] > 1e-3
    assert tv_budget["tv"] <= 0.1 * tv_budget["positions"] + 1e-6
    assert mentored["kl"] <= 0.05 * mentored["positions"] + 1e-5
    for entry in (live, mars, tv_budget, mentored):  # alpha <= 1 - TV(q, p) + TV(P_V, p), summed
        assert entry["accept"] <= entry["positions"] - entry["draft_tv"] + entry["tv"] + 1e-5
    assert measured.fidelity_s > 0 and all(step.fidelity is None for step in plain.steps)


def test_greedy_fidelity_counts_deviations_from_the_argmax_and_has_no_kl(pair):
    target, drafter = pair
    result = decode(target, drafter, get_verifier("mars", theta=0.3), [2, 4, 6], max_new_tokens=40, gamma=4, fidelity=True)
    (live,) = result.fidelity()
    assert live["kl"] is None and live["judged_kl"] is None
    assert live["judged_tv"] == result.relaxed  # a relaxed accept is the one way greedy MARS leaves the argmax
    assert live["tv"] == int(live["tv"])


def test_expected_kept_drafts_of_a_chain():
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([]) == 0 and math.isclose(expected_accepted([1.0] * 4), 4)
