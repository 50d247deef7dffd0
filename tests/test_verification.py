"""The verifiers on hand-built logits: each rule decides exactly as its docstring says."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from mars_bench.verification import (
    MarsParams,
    Reason,
    VerifyInput,
    available_verifiers,
    get_verifier,
    register_verifier,
    verifier_settings,
)
from mars_bench.verification.kernels import top_two
from mars_bench.verification.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


def step_from(rows: list[list[float]], drafts: list[int], sampling: SamplingParams = GREEDY, **extra) -> VerifyInput:
    drafts_t = torch.tensor(drafts, dtype=torch.long)
    return VerifyInput(
        draft_tokens=drafts_t,
        parents=torch.arange(-1, len(drafts) - 1),
        target_logits=torch.tensor(rows, dtype=torch.float32),
        sampling=sampling,
        **extra,
    )


def margin_row(z1: float, z2: float, vocab: int = 5, low: float = -20.0) -> list[float]:
    """Token 0 has logit z1, token 1 has z2, the rest ``low``."""
    return [z1, z2] + [low] * (vocab - 2)


def test_registry_lists_the_shipped_verifiers():
    assert {"exact", "rejection", "mars", "mars_ref", "typical"} <= set(available_verifiers())
    assert get_verifier("exact").lossless and get_verifier("rejection").lossless
    assert not get_verifier("mars").lossless and not get_verifier("mars_ref").lossless
    declared = {name: [item.name for item in get_verifier(name).statistics] for name in available_verifiers()}
    assert {name for name, names in declared.items() if "trigger" in names} == {"mars", "mars_ref"}
    assert declared["fly"] == ["entropy", "gate"] and declared["bild"] == ["rollback"] and declared["exact"] == []


@pytest.mark.parametrize(
    ("name", "described"),
    [
        ("exact", {}),
        ("rejection", {}),
        ("mars", {"theta": 0.9, "guard": "never", "correction": "residual"}),
        ("mars_ref", {"theta": 0.9}),
        ("typical", {"epsilon": 0.09, "delta": 0.3}),
        ("top_m", {"m": 2}),
        ("lenient", {"lenience": 0.5}),
        ("cascade", {"rule": "chow", "alpha": 0.3}),
        ("mentored", {"kl_budget": 0.05}),
        ("tv_budget", {"eps": 0.1}),
    ],
)
def test_describe_reports_the_default_settings(name, described):
    verifier = get_verifier(name)
    assert verifier.describe() == {"name": name, **described}
    assert isinstance(verifier.params, verifier_settings(name))
    # an option added later (mars's entropy_gate) is described only when set, so old labels still match
    options = [field.name for field in dataclasses.fields(verifier_settings(name)) if not field.metadata]
    assert options == list(described)


def test_settings_are_normalised_and_frozen():
    verifier = get_verifier("mars", theta=1, guard="gap")
    assert verifier.describe() == {"name": "mars", "theta": 1.0, "guard": "gap", "correction": "residual"}
    assert isinstance(verifier.params.theta, float)
    assert verifier_settings("mars") is MarsParams and MarsParams(theta=None).theta is None  # nothing added to it
    with pytest.raises(dataclasses.FrozenInstanceError):
        verifier.params.theta = 0.5  # type: ignore[misc]


def test_a_verifier_registers_only_with_a_frozen_settings_class():
    @dataclasses.dataclass
    class Mutable:
        level: int = 1

    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        register_verifier("mutable", params=Mutable)
    assert "mutable" not in available_verifiers()


def test_exact_keeps_the_longest_prefix_equal_to_the_argmax():
    rows = [[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5]]
    verdict = get_verifier("exact").verify(step_from(rows, [1, 2, 3]))
    assert verdict.accepted.tolist() == [0, 1]
    assert verdict.next_token == 0  # the argmax where the draft failed
    assert verdict.decisions.reasons.tolist() == [Reason.EXACT, Reason.EXACT, Reason.REJECTED]


def test_exact_emits_the_bonus_argmax_after_a_fully_accepted_chain():
    rows = [[0, 5, 0, 0], [0, 0, 5, 0], [0, 0, 0, 5]]
    verdict = get_verifier("exact").verify(step_from(rows, [1, 2]))
    assert verdict.accepted_len == 2 and verdict.next_token == 3
    assert len(verdict.decisions.reasons) == 2


@pytest.mark.parametrize(
    ("z1", "z2", "guard", "relaxes"),
    [
        (10.0, 9.5, "never", True),  # r = 0.95 > 0.9
        (10.0, 9.0, "never", False),  # r = 0.9 is not > 0.9 (strict)
        (10.0, 8.5, "never", False),
        (30.0, 27.5, "never", True),  # gap 2.5 < 3 at z1 = 30
        (-1.0, -1.05, "never", False),  # z1 <= 0: the default guard never relaxes
        (-1.0, -1.05, "gap", True),  # gap 0.05 < 0.1 * |z1|
        (-1.0, -3.0, "gap", False),  # the raw ratio 3.0 would fire; the gap form does not
        (0.0, -0.01, "never", False),
        (0.0, -0.01, "gap", False),  # z1 = 0 allows no gap
        (1e-6, 0.95e-6, "never", True),  # tiny but positive: the ratio decides
        (1e-6, -5.0, "never", False),
        (4.0, 4.0, "never", True),  # a tie: r = 1, token 0 is the top token (the first maximum)
    ],
)
def test_mars_greedy_relaxes_the_runner_up_exactly_when_the_margin_holds(z1, z2, guard, relaxes):
    step = step_from([margin_row(z1, z2), margin_row(1.0, 0.0)], [1], GREEDY)
    verdict = get_verifier("mars", theta=0.9, guard=guard).verify(step)
    assert verdict.accepted_len == int(relaxes)
    assert verdict.decisions.statistics["trigger"].tolist() == [relaxes]
    assert verdict.decisions.statistics["nonpositive_top1"].tolist() == [z1 <= 0]
    assert verdict.decisions.reasons.tolist() == [Reason.RELAXED if relaxes else Reason.REJECTED]
    assert verdict.next_token == 0  # bonus argmax of row 1, or the correction argmax of row 0


def test_mars_never_accepts_rank_three_or_lower():
    step = step_from([[10.0, 9.9, 9.8, 0.0], [1, 0, 0, 0]], [2])
    verdict = get_verifier("mars", theta=0.5).verify(step)
    assert verdict.accepted_len == 0 and verdict.next_token == 0


def test_mars_records_the_margin_statistic():
    step = step_from([margin_row(10.0, 9.5), margin_row(1.0, 0.0)], [0])
    decisions = get_verifier("mars").verify(step).decisions
    assert decisions.statistics["margin"].tolist() == pytest.approx([0.95])
    assert decisions.statistics["margin"].dtype == torch.float32 and decisions.statistics["trigger"].dtype == torch.bool


@pytest.mark.parametrize(("name", "settings"), [("exact", {}), ("mars", {"theta": None}), ("mars", {}), ("mars_ref", {})])
def test_a_draft_tied_for_the_top_logit_is_the_top_token(name, settings):
    # Tokens 0 and 1 tie; the top token is the first maximum (torch.argmax, as the baseline
    # decoder's greedy choice and the official code's argmax). A rule that tested the draft
    # against one tied index and emitted another rejected token 0 and then emitted it.
    step = step_from([[4.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [0])
    verdict = get_verifier(name, **settings).verify(step)
    assert verdict.accepted.tolist() == [0] and verdict.next_token == 0
    assert verdict.decisions.reasons.tolist() == [Reason.EXACT]


def test_the_top_token_is_the_first_maximum_on_rows_with_ties():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 3, (2000, 6), generator=generator).float()  # most rows tie at the top
    rows[0] = torch.tensor([2.0, 5.0, 5.0, 5.0, 1.0, 5.0])
    top = top_two(rows)
    assert torch.equal(top.t1, torch.argmax(rows, dim=-1))
    assert top.t1[0] == 1 and top.t2[0] == 2 and top.z2[0] == 5.0
    for row, t1, z2, t2 in zip(rows.tolist(), top.t1.tolist(), top.z2.tolist(), top.t2.tolist()):
        assert row[t1] == max(row) and z2 == sorted(row)[-2]
        assert t2 == min(j for j in range(len(row)) if j != t1 and row[j] == z2)
    ties = rows == rows.max(dim=-1, keepdim=True).values
    assert (ties.sum(-1) > 1).float().mean() > 0.3  # the rows do test ties


def tie_heavy_step(generator: torch.Generator, tree: bool) -> VerifyInput:
    """Small integer logits (many ties); drafts mostly among a row's tied maxima."""
    vocab, count = 4, int(torch.randint(0, 5, (1,), generator=generator))
    parents = [-1, -1, 0, 0, 1][:count] if tree else list(range(-1, count - 1))
    rows = torch.randint(0, 3, (count + 1, vocab), generator=generator).float()
    drafts: list[int] = []
    for node, parent in enumerate(parents):
        ties = torch.nonzero(rows[parent + 1] == rows[parent + 1].max()).flatten().tolist()
        siblings = [drafts[other] for other in range(node) if parents[other] == parent]
        pool = ties if torch.rand(1, generator=generator) < 0.8 else range(vocab)
        choices = [token for token in pool if token not in siblings] or [token for token in range(vocab) if token not in siblings]
        drafts.append(choices[int(torch.randint(0, len(choices), (1,), generator=generator))])
    return VerifyInput(torch.tensor(drafts, dtype=torch.long), torch.tensor(parents, dtype=torch.long), rows)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.slow
def test_mars_off_switch_equals_exact_in_greedy_under_ties(tree):
    generator = torch.Generator().manual_seed(0)
    off, exact = get_verifier("mars", theta=None), get_verifier("exact")
    accepted_lengths = []
    for _ in range(1000):
        step = tie_heavy_step(generator, tree)
        mine, reference = off.verify(step), exact.verify(step)
        assert mine.accepted.tolist() == reference.accepted.tolist() and mine.next_token == reference.next_token
        assert mine.decisions.reasons.tolist() == reference.decisions.reasons.tolist()
        accepted_lengths.append(reference.accepted_len)
    assert max(accepted_lengths) >= 2 and min(accepted_lengths) == 0


@pytest.mark.parametrize("correction", ["residual", "target"])
def test_mars_off_switch_equals_rejection_in_sampling(correction):
    generator = torch.Generator().manual_seed(1)
    for trial in range(200):
        rows = torch.randn(4, 6, generator=generator) * 2
        dists = torch.softmax(torch.randn(3, 6, generator=generator), -1)
        drafts = torch.multinomial(dists, 1, generator=generator).flatten()
        step = VerifyInput(drafts, torch.arange(-1, 2), rows, SAMPLE, draft_dists=dists)
        mars = get_verifier("mars", theta=None, correction=correction).verify(
            step, generator=torch.Generator().manual_seed(trial)
        )
        strict = get_verifier("rejection").verify(step, generator=torch.Generator().manual_seed(trial))
        assert mars.accepted.tolist() == strict.accepted.tolist()
        assert mars.next_token == strict.next_token


@pytest.mark.slow
def test_mars_target_correction_samples_p_after_a_triggered_reject():
    rows = [[3.0, 2.9, 2.5, 1.0], [0.0, 0.0, 0.0, 0.0]]  # triggered; the draft (2) is outside the top 2
    dists = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # q(2) = 1 > p(2): the strict test may reject it
    mars = get_verifier("mars", theta=0.9, correction="target")
    emitted = []
    for seed in range(2000):
        verdict = mars.verify(step_from(rows, [2], SAMPLE, draft_dists=dists), generator=torch.Generator().manual_seed(seed))
        if verdict.accepted_len == 0:
            emitted.append(verdict.next_token)
    # From p itself, the rejected draft can come back; from the residual it never could.
    assert 2 in emitted


def test_mars_sampling_accepts_a_triggered_runner_up_every_time():
    # p(runner-up) is small next to q = 0.9, so the strict test alone would usually reject it.
    rows = [margin_row(10.0, 9.2, vocab=4), margin_row(1.0, 0.0, vocab=4)]
    dists = torch.tensor([[0.05, 0.9, 0.03, 0.02]])
    step = step_from(rows, [1], SAMPLE, draft_dists=dists)
    mars = get_verifier("mars", theta=0.9)
    verdicts = [mars.verify(step, generator=torch.Generator().manual_seed(seed)) for seed in range(50)]
    assert all(v.accepted_len == 1 for v in verdicts)
    assert sum(v.decisions.reasons.tolist() == [Reason.RELAXED] for v in verdicts) > 25


def test_typical_accepts_by_the_entropy_threshold():
    # Row 0 is almost deterministic on token 0: token 1 falls below min(eps, delta * exp(-H)).
    rows = [[10.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    typical = get_verifier("typical", epsilon=0.09, delta=0.3)
    assert typical.verify(step_from(rows, [1], SAMPLE), generator=torch.Generator().manual_seed(0)).accepted_len == 0
    assert typical.verify(step_from(rows, [0], SAMPLE), generator=torch.Generator().manual_seed(0)).accepted_len == 1
    # A flat row (H = log 4): threshold min(0.09, 0.3 / 4) = 0.075 < 0.25, any draft passes.
    flat = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert typical.verify(step_from(flat, [3], SAMPLE), generator=torch.Generator().manual_seed(0)).accepted_len == 1


def test_top_k_and_top_p_filter_before_the_margin_is_measured():
    rows = [margin_row(10.0, 9.5), margin_row(1.0, 0.0)]
    top1_only = SamplingParams(temperature=1.0, top_k=1)
    verdict = get_verifier("mars").verify(step_from(rows, [1], top1_only), generator=torch.Generator().manual_seed(0))
    assert verdict.accepted_len == 0  # z2 became -inf: no relaxation, and p(token 1) = 0
    assert verdict.next_token == 0


@pytest.mark.parametrize("name", ["exact", "rejection", "mars", "mars_ref", "typical"])
def test_empty_drafts_emit_the_target_choice(name):
    step = step_from([[0.0, 3.0, 0.0]], [])
    verdict = get_verifier(name).verify(step)
    assert verdict.accepted_len == 0 and verdict.next_token == 1


def test_a_vocabulary_of_one_is_handled():
    step = step_from([[2.0], [1.0]], [0], SAMPLE)
    for name in ("exact", "rejection", "mars", "mars_ref", "typical"):
        verdict = get_verifier(name).verify(step, generator=torch.Generator().manual_seed(0))
        assert verdict.accepted_len == 1 and verdict.next_token == 0


def test_mars_reports_its_trigger_per_visited_depth():
    # Depth 0: triggered (r = 0.95), the runner-up is relaxed; depth 1: not triggered (r = 0.5), rejected.
    rows = [margin_row(10.0, 9.5), margin_row(10.0, 5.0), margin_row(1.0, 0.0)]
    for settings in ({}, {"guard": "gap"}):
        decisions = get_verifier("mars", **settings).verify(step_from(rows, [1, 1])).decisions
        assert decisions.reasons.tolist() == [Reason.RELAXED, Reason.REJECTED]
        assert decisions.statistics["trigger"].tolist() == [True, False]
        assert decisions.statistics["margin"].tolist() == pytest.approx([0.95, 0.5])
    off = get_verifier("mars", theta=None).verify(step_from(rows, [0, 0])).decisions
    assert off.statistics["trigger"].tolist() == [False, False]
    sampled = get_verifier("mars").verify(step_from(rows, [1, 1], SAMPLE), generator=torch.Generator().manual_seed(0))
    assert sampled.decisions.statistics["trigger"].tolist()[0] is True


def test_mars_reports_the_trigger_of_the_rows_a_tree_walk_visits():
    # Root row triggered; node 1 (token 1, relaxed) judges with row 2, which is not triggered.
    rows = [margin_row(10.0, 9.5), margin_row(1.0, 0.0), margin_row(10.0, 1.0), margin_row(9.0, 8.9)]
    step = VerifyInput(torch.tensor([3, 1, 4]), torch.tensor([-1, -1, 1]), torch.tensor(rows))
    decisions = get_verifier("mars").verify(step).decisions
    assert decisions.reasons.tolist() == [Reason.RELAXED, Reason.REJECTED]
    assert decisions.statistics["trigger"].tolist() == [True, False]


@pytest.mark.parametrize("name", ["exact", "rejection", "typical"])
def test_verifiers_that_declare_no_statistic_report_none(name):
    step = step_from([margin_row(10.0, 9.5), margin_row(1.0, 0.0)], [1], SAMPLE)
    decisions = get_verifier(name).verify(step, generator=torch.Generator().manual_seed(0)).decisions
    assert get_verifier(name).statistics == () and decisions.statistics == {}


def test_reason_codes_import_without_torch():
    code = "import sys, mars_bench.common.reasons; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    from mars_bench.common import reasons
    from mars_bench.verification import base

    assert Reason is reasons.Reason is base.Reason
    assert [(code.name, int(code)) for code in Reason] == [("EXACT", 0), ("RELAXED", 1), ("SAMPLED", 2), ("REJECTED", 3)]


UNKNOWN_STRICT = "unknown verifier 'strict': allowed are bild, cascade, exact, fly, fsd, lenient, lossy_sd, mars"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: get_verifier("strict"), UNKNOWN_STRICT),
        (lambda: get_verifier("mars", theta=0.0), r"theta=0.0 is invalid: allowed is a number in \(0, 1\]"),
        (lambda: get_verifier("mars", theta=1.5), "theta=1.5 is invalid"),
        (lambda: get_verifier("mars", theta=-0.2), "theta=-0.2 is invalid"),
        (lambda: get_verifier("mars", theta="high"), "theta='high' is invalid"),
        (lambda: get_verifier("mars_ref", theta=2), "theta=2 is invalid"),
        (lambda: get_verifier("mars", guard="clip"), "guard='clip' is invalid: allowed are never, gap"),
        (lambda: get_verifier("mars", correction="argmax"), "correction='argmax' is invalid"),
        (lambda: get_verifier("typical", delta=0), r"delta=0 is invalid: allowed is a number in \(0, 1\]"),
        (lambda: get_verifier("mars", thet=0.9), "^verifier mars has no setting 'thet': allowed are theta, .*, entropy_gate$"),
        (
            lambda: get_verifier("mars_ref", guard="gap"),
            "^verifier mars_ref has no setting 'guard': allowed are theta$",
        ),
        (lambda: get_verifier("exact", theta=0.9), "^verifier exact has no setting 'theta': allowed are none$"),
        (lambda: get_verifier("rejection", a=1, b=2), "^verifier rejection has no settings 'a', 'b': allowed are none$"),
        (lambda: verifier_settings("strict"), UNKNOWN_STRICT),
        (lambda: SamplingParams(temperature=-0.5), "temperature=-0.5 is invalid: allowed is a finite number >= 0"),
        (lambda: SamplingParams(top_p=0.0), r"top_p=0.0 is invalid: allowed is a number in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.2), "top_p=1.2 is invalid"),
        (lambda: SamplingParams(top_k=-1), "top_k=-1 is invalid"),
    ],
)
def test_bad_settings_fail_with_one_line_naming_the_value(build, message):
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


def test_theta_one_is_allowed_and_never_relaxes_positive_logits():
    step = step_from([margin_row(10.0, 9.99), margin_row(1.0, 0.0)], [1])
    assert get_verifier("mars", theta=1.0).verify(step).accepted_len == 0
