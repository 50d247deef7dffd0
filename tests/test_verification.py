"""The verifiers on hand-built logits: each rule decides exactly as its docstring says."""

from __future__ import annotations

import pytest
import torch

from mars_bench.verification import Reason, VerifyInput, available_verifiers, get_verifier
from mars_bench.verification.sampling import SamplingParams

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
        (4.0, 4.0, "never", True),  # a tie: r = 1
    ],
)
def test_mars_greedy_relaxes_the_runner_up_exactly_when_the_margin_holds(z1, z2, guard, relaxes):
    step = step_from([margin_row(z1, z2), margin_row(1.0, 0.0)], [1], GREEDY)
    verdict = get_verifier("mars", theta=0.9, guard=guard).verify(step)
    if z1 == z2:  # which tied index is "top-1" is arbitrary; the other one is the runner-up
        assert verdict.accepted_len == 1
        return
    assert verdict.accepted_len == int(relaxes)
    assert verdict.decisions.reasons.tolist() == [Reason.RELAXED if relaxes else Reason.REJECTED]
    assert verdict.next_token == 0  # bonus argmax of row 1, or the correction argmax of row 0


def test_mars_never_accepts_rank_three_or_lower():
    step = step_from([[10.0, 9.9, 9.8, 0.0], [1, 0, 0, 0]], [2])
    verdict = get_verifier("mars", theta=0.5).verify(step)
    assert verdict.accepted_len == 0 and verdict.next_token == 0


def test_mars_records_the_margin_statistic():
    step = step_from([margin_row(10.0, 9.5), margin_row(1.0, 0.0)], [0])
    decisions = get_verifier("mars").verify(step).decisions
    assert decisions.margin.tolist() == pytest.approx([0.95])
    assert decisions.top1_logit.tolist() == [10.0] and decisions.top2_logit.tolist() == [9.5]


def test_mars_off_switch_equals_exact_in_greedy():
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = torch.randn(5, 6, generator=generator) * 3
        drafts = torch.randint(0, 6, (4,), generator=generator)
        step = VerifyInput(drafts, torch.arange(-1, 3), rows)
        off, exact = get_verifier("mars", theta=None).verify(step), get_verifier("exact").verify(step)
        assert off.accepted.tolist() == exact.accepted.tolist() and off.next_token == exact.next_token


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


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: get_verifier("strict"), "unknown verifier 'strict': allowed are exact, mars"),
        (lambda: get_verifier("mars", theta=0.0), r"theta=0.0 is invalid: allowed is a number in \(0, 1\]"),
        (lambda: get_verifier("mars", theta=1.5), "theta=1.5 is invalid"),
        (lambda: get_verifier("mars", theta=-0.2), "theta=-0.2 is invalid"),
        (lambda: get_verifier("mars", theta="high"), "theta='high' is invalid"),
        (lambda: get_verifier("mars_ref", theta=2), "theta=2 is invalid"),
        (lambda: get_verifier("mars", guard="clip"), "guard='clip' is invalid: allowed are never, gap"),
        (lambda: get_verifier("mars", correction="argmax"), "correction='argmax' is invalid"),
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
