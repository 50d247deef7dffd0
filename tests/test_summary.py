"""The run summary: speedup is the throughput ratio over paired prompts, tau the emitted
tokens over verification steps, and the bootstrap interval covers the point estimate."""

from __future__ import annotations

import numpy as np
import pytest

from mars_bench.bench.records import SCHEMA_VERSION
from mars_bench.bench.stats import bootstrap_ratio_ci, mean_rate_ratio, throughput_ratio
from mars_bench.bench.summary import format_table, summarise


def row(question, method, tokens, seconds, steps, **extra):
    return {
        "cell": "c", "question_id": question, "turn": 1, "method": method, "verifier": "mars", "theta": 0.9,
        "new_tokens": tokens, "prefill_s": 0.0, "decode_s": seconds, "steps": steps, "drafted": 0, "accepted": 0, "relaxed": 0,
        "trigger_count": 0, "verified_positions": 0, "agreement": 1.0, "score": None, "status": "ok", **extra,
    }  # fmt: skip


ROWS = [
    row(0, "baseline", 100, 10.0, 99),
    row(0, "mars", 100, 5.0, 33),
    row(1, "baseline", 50, 5.0, 49),
    row(1, "mars", 50, 4.0, 7),
]


def test_speedup_and_tau_match_hand_computed_values():
    summary = summarise(ROWS).set_index("method")
    assert summary.loc["mars", "speedup"] == pytest.approx((150 / 9.0) / (150 / 15.0))
    assert summary.loc["mars", "speedup_mean_rate"] == pytest.approx(((100 / 5 + 50 / 4) / 2) / ((100 / 10 + 50 / 5) / 2))
    assert summary.loc["mars", "tau"] == pytest.approx((99 + 49) / (33 + 7))
    assert summary.loc["baseline", "tau"] == pytest.approx(1.0)
    assert summary.loc["mars", "speedup_ci_low"] <= summary.loc["mars", "speedup"] <= summary.loc["mars", "speedup_ci_high"]
    assert "| c | mars | 2 |" in format_table(summarise(ROWS))
    assert summary["verifier_setting"].to_dict() == {"baseline": "", "mars": ""}  # rows of an older writer carry none
    setting = "theta=0.9,guard=never,correction=residual"
    written = summarise([{**row, "verifier_setting": setting} for row in ROWS]).set_index("method")
    assert written.loc["mars", "verifier_setting"] == setting and "theta" not in written


def test_the_ratios_agree_on_equal_prompts():
    args = ([10, 10], [1.0, 1.0], [10, 10], [2.0, 2.0])
    assert throughput_ratio(*args) == pytest.approx(2.0) == mean_rate_ratio(*args)
    assert bootstrap_ratio_ci(*args) == pytest.approx((2.0, 2.0))


def test_a_verifier_without_a_trigger_reports_no_trigger_rate():
    rows = [row(0, "baseline", 100, 10.0, 99, trigger_count=None, verified_positions=0),
            row(0, "rejection", 100, 5.0, 33, verifier="rejection", trigger_count=None, verified_positions=99),
            row(1, "baseline", 50, 5.0, 49, cell="d", trigger_count=None),
            row(1, "mars", 50, 4.0, 7, cell="d", trigger_count=3, verified_positions=12)]  # fmt: skip
    summary = summarise(rows).set_index("method")
    assert summary["trigger_rate"].isna()[["baseline", "rejection"]].all()
    assert summary.loc["mars", "trigger_rate"] == pytest.approx(3 / 12)
    assert "| c | rejection | 1 |" in format_table(summarise(rows)) and "| - |" in format_table(summarise(rows))


def test_each_count_statistic_a_verifier_declares_has_its_rate_and_older_rows_read_as_the_same_statistics():
    new = {"schema_version": SCHEMA_VERSION}
    rows = [row(0, "baseline", 100, 10.0, 99, **new),
            row(0, "mars", 100, 5.0, 33, **new, rule_counts={"trigger": 3, "nonpositive_top1": 1}, verified_positions=12),
            row(1, "baseline", 50, 5.0, 49, **new),
            row(1, "mars", 50, 4.0, 7, **new, rule_counts={"trigger": 1, "nonpositive_top1": 0}, verified_positions=4),
            row(0, "fly", 100, 5.0, 30, cell="f", verifier="fly", **new, rule_counts={"gate": 5}, verified_positions=10),
            row(0, "baseline", 100, 10.0, 99, cell="f", **new)]  # fmt: skip
    summary = summarise(rows).set_index("method")
    assert summary.loc["mars", "trigger_rate"] == pytest.approx(4 / 16)
    assert summary.loc["mars", "nonpositive_top1_rate"] == pytest.approx(1 / 16) and np.isnan(summary.loc["mars", "gate_rate"])
    assert summary.loc["fly", "gate_rate"] == pytest.approx(0.5) and np.isnan(summary.loc["fly", "trigger_rate"])
    assert list(summary.columns[summary.columns.get_loc("relaxed") + 1 :][:3]) == ["trigger_rate", "nonpositive_top1_rate",
                                                                                     "gate_rate"]  # fmt: skip
    table = format_table(summarise(rows))
    assert "| rule statistics (rate) |" in table and "| trigger 0.250, nonpositive_top1 0.062 |" in table
    assert "| gate 0.500 |" in table
    # rows of schema 14 and older carry the margin rule's counters under their own names: the same statistics
    old = [{key: value for key, value in r.items() if key not in ("rule_counts", "schema_version")} for r in rows[:4]]
    old[1] |= {"trigger_count": 3, "nonpositive_top1": 1}
    old[3] |= {"trigger_count": 1, "nonpositive_top1": 0}
    older = summarise(old).set_index("method")
    assert older.loc["mars", "trigger_rate"] == summary.loc["mars", "trigger_rate"]
    assert older.loc["mars", "nonpositive_top1_rate"] == summary.loc["mars", "nonpositive_top1_rate"]


def test_no_rows_give_an_empty_summary_not_a_traceback():
    assert format_table(summarise([])) == "no finished rows to summarise"


def test_a_method_is_summarised_over_all_its_rows_and_its_speedup_over_the_paired_ones():
    rows = [ROWS[0], ROWS[1], {**ROWS[2], "status": "failed"}, ROWS[3]]  # the second baseline failed
    summary = summarise(rows).set_index("method")
    assert summary.loc["mars", "prompts"] == 2 and summary.loc["mars", "tokens"] == 150
    assert summary.loc["mars", "tau"] == pytest.approx((99 + 49) / (33 + 7))
    assert summary.loc["mars", "speedup"] == pytest.approx((100 / 5.0) / (100 / 10.0))  # question 0 only


def test_tau_is_pooled_and_its_mean_per_request_stands_beside_it_even_where_they_order_methods_differently():
    rows = [row(0, "baseline", 100, 10.0, 99), row(1, "baseline", 100, 10.0, 99),
            row(0, "mars", 91, 5.0, 10), row(1, "mars", 11, 5.0, 10),  # emitted 90 and 10 in 10 steps each: 9 and 1
            row(0, "typical", 15, 5.0, 2, verifier="typical"), row(1, "typical", 61, 5.0, 15, verifier="typical")]  # 7, 4
    summary = summarise(rows).set_index("method")
    assert summary.loc["mars", "tau"] == pytest.approx(100 / 20) and summary.loc["mars", "tau_request_mean"] == pytest.approx(5.0)
    assert summary.loc["typical", "tau"] == pytest.approx(74 / 17) and summary.loc["typical", "tau_request_mean"] == 5.5
    assert summary.loc["mars", "tau"] > summary.loc["typical", "tau"]  # pooled: mars ahead
    assert summary.loc["mars", "tau_request_mean"] < summary.loc["typical", "tau_request_mean"]  # per request: typical
    assert "| tau | tau (mean per request) |" in format_table(summary.reset_index())
    one_token = summarise([row(0, "baseline", 1, 1.0, 0), row(0, "mars", 1, 1.0, 0)]).set_index("method")
    assert np.isnan(one_token.loc["mars", "tau_request_mean"])  # no verification step: no tau of its own
