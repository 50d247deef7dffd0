"""Stop rules (``drafting/stop.py``): what ends a draft early, and how the gain stop learns from verdicts."""

from __future__ import annotations

import pytest

from mars_bench.decoding.draft_length import DraftLengthSettings
from mars_bench.drafting import drafters_with_stops
from mars_bench.drafting.stop import ConfidenceStop, GainStop
from mars_bench.method import MethodSpec


def test_a_fresh_gain_stop_trusts_q_and_drafts_while_the_expected_gain_pays_at_an_autoregressive_rate():
    stop = GainStop(0.15)
    assert [stop.acceptance(q) for q in (0.0, 0.35, 0.97)] == pytest.approx([0.0, 0.35, 0.97])
    assert stop.rate == 1.0  # the prior: one autoregressive step
    assert stop.keep_drafting([0.5])  # 0.5 * 0.5 = 0.25 >= 0.15 * 1
    assert not stop.keep_drafting([0.3])  # 0.09 < 0.15
    assert stop.keep_drafting([0.9, 0.9, 0.9])  # 0.9^4 = 0.66
    assert not stop.keep_drafting([0.9, 0.9, 0.3])  # 0.9^2 * 0.3 * 0.3 = 0.073


def test_verdicts_teach_what_a_q_is_worth_and_raise_the_rate_that_further_drafts_must_beat():
    stop = GainStop(0.15)
    for _ in range(6):  # every token at q 0.95 kept, then the one at q 0.55 rejected, the last never judged
        stop.verdict([0.95, 0.95, 0.95, 0.55, 0.2], 3)
    assert stop.acceptance(0.95) == pytest.approx((2 * 0.95 + 18) / (2 + 18))
    assert stop.acceptance(0.55) == pytest.approx((2 * 0.55 + 0) / (2 + 6))
    assert stop.acceptance(0.25) == pytest.approx(0.25)  # the unjudged token taught nothing
    assert stop.rate == pytest.approx((1 + 6 * 4) / (1 + 6 * (1 + 0.15 * 5)))
    assert GainStop(0.15).keep_drafting([0.95, 0.55]) and not stop.keep_drafting([0.95, 0.55])
    assert stop.keep_drafting([0.95, 0.95])  # 0.995^3 = 0.985 >= 0.15 * 2.17: confident runs still go on
    assert not stop.keep_drafting([0.95, 0.95, 0.95, 0.55])  # 0.985 * 0.1375^2 = 0.019 < 0.326


def test_a_fresh_copy_forgets_what_was_learned_and_an_empty_step_counts_as_one_autoregressive_token():
    stop = GainStop(0.2)
    stop.verdict([0.9, 0.9], 0)
    stop.verdict([], 0)  # a step without drafts (the budget's last token)
    assert stop.rate == pytest.approx(3 / (1 + 1.4 + 1))
    fresh = stop.fresh()
    assert (fresh.draft_cost, fresh.rate, fresh.acceptance(0.9)) == (0.2, 1.0, pytest.approx(0.9))
    assert stop.acceptance(0.9) < 0.9  # the original keeps its own


def test_the_confidence_stop_ends_after_a_token_below_its_threshold_whatever_came_before():
    stop = ConfidenceStop(0.6)
    assert stop.keep_drafting([0.1, 0.6]) and not stop.keep_drafting([0.99, 0.59])
    stop.verdict([0.99, 0.59], 0)
    assert stop.keep_drafting([0.6]) and stop.fresh() == stop


@pytest.mark.parametrize("value", [0, -0.5, float("inf"), float("nan"), True, "cheap"])
def test_a_bad_draft_cost_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"drafter.draft_cost=.* is invalid: allowed is a number > 0"):
        DraftLengthSettings("gain", draft_cost=value).draft_stop()


@pytest.mark.parametrize("drafter", ["lookup", "model_tree"])
def test_a_stop_policy_with_a_drafter_that_applies_no_stop_rule_is_refused_in_one_line(drafter):
    message = f"drafter.length=gain ends drafts by the drafter's own q, which drafter={drafter} does not apply: allowed"
    with pytest.raises(ValueError, match=message):
        MethodSpec.create(drafter, "exact", length=DraftLengthSettings("gain", gamma=4))
    assert drafters_with_stops() == ["layerskip", "model"]
    MethodSpec.create("none", None, length=DraftLengthSettings("gain"))  # the AR baseline beside a gain-stopped method


def test_each_policy_gives_its_stop_rule():
    assert DraftLengthSettings("fixed").draft_stop() is None and DraftLengthSettings("schedule").draft_stop() is None
    assert DraftLengthSettings("confidence", min_confidence=0.3).draft_stop() == ConfidenceStop(0.3)
    assert DraftLengthSettings("gain", draft_cost=0.2).draft_stop().draft_cost == 0.2
