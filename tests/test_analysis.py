"""analysis/: every table cell equals a value computed by hand from synthetic records; the
confidence intervals cover the true value at their nominal rate in simulation; a partial or
empty sweep gives a clear message; the package never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mars_bench.analysis.__main__ import main
from mars_bench.analysis.acceptance import (
    acceptance_by_value,
    alpha_per_depth,
    positions,
    shadow_labels,
    shadow_table,
    value_statistics,
)
from mars_bench.analysis.cells import NotEnoughData, method_summary
from mars_bench.analysis.figures import _drafter_title, pareto, pareto_front
from mars_bench.analysis.gather import NoRecordsError, gather
from mars_bench.analysis.quality import quality_table
from mars_bench.analysis.tables import table1, to_latex, to_markdown
from mars_bench.bench.records import SCHEMA_VERSION, read_rows
from mars_bench.bench.stats import bootstrap_mean_ci, bootstrap_ratio_ci, paired_permutation_p

REPO = Path(__file__).resolve().parents[1]


def record(question, method, tokens, seconds, steps, *, task="humaneval", verifier="mars", theta=0.9, status="ok", **extra):
    return {
        "cell": "c", "model": "qwen", "drafter": "model", "task": task, "temperature": 1.0, "verifier": verifier,
        "theta": theta, "question_id": question, "turn": 1, "method": method, "status": status, "new_tokens": tokens,
        "prefill_s": 0.0, "decode_s": seconds, "steps": steps, **extra,
    }  # fmt: skip


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def sweep(tmp_path):
    write_run(
        tmp_path / "sweep" / "0",
        [record(0, "baseline", 100, 10.0, 99), record(0, "mars", 100, 4.0, 24), record(1, "baseline", 51, 5.0, 50),
         record(1, "mars", 51, 3.0, 10), record(2, "mars", 9, 9.0, 8, status="failed")],
    )  # fmt: skip
    write_run(
        tmp_path / "sweep" / "1",
        [record(0, "baseline", 80, 8.0, 79, task="gsm8k"), record(0, "mars", 80, 2.0, 19, task="gsm8k")],
    )
    return tmp_path / "sweep"


def test_table1_cells_equal_hand_computed_values(sweep):
    table = table1(gather([sweep]))
    row = table.loc[("qwen", "model", 1.0, "mars")]  # one setting of mars: its bare name
    assert row[("humaneval", "speedup")] == pytest.approx((151 / 7.0) / (151 / 15.0))
    assert row[("humaneval", "tau")] == pytest.approx((99 + 50) / (24 + 10))  # the failed row is left out
    assert row[("humaneval", "tau_request_mean")] == pytest.approx((99 / 24 + 50 / 10) / 2)  # beside it: per request
    assert row[("Mean", "tau_request_mean")] == pytest.approx(((99 / 24 + 50 / 10) / 2 + 79 / 19) / 2)
    assert [metric for task, metric in table.columns if task == "gsm8k"] == ["speedup", "tau", "tau_request_mean",
                                                                              "finished_share"]  # fmt: skip
    assert row[("gsm8k", "speedup")] == pytest.approx(4.0)
    assert row[("Mean", "speedup")] == pytest.approx(((151 / 7.0) / (151 / 15.0) + 4.0) / 2)
    assert "| qwen | model | 1.00 | mars |" in to_markdown(table)
    latex = to_latex(table)
    assert "\\toprule" in latex and "\\bottomrule" in latex


SCORES = {  # question -> (baseline, rejection, mars 0.9, mars 0.98)
    0: (1, 1, 0, 1), 1: (1, 1, 0, 1), 2: (0, 1, 0, 1), 3: (1, 0, 0, 0), 4: (0, 1, 0, 1), 5: (1, 1, 1, 1),
}  # fmt: skip


def scored_sweep(tmp_path, with_strict=True, draft_length="fixed"):
    """Three cells of one sweep sharing their baselines: rejection, mars 0.9, mars 0.98."""
    cells = [("rejection", None), ("mars", 0.9), ("mars", 0.98)][0 if with_strict else 1 :]
    for index, (verifier, theta) in enumerate(cells):
        column = {"rejection": 1, 0.9: 2, 0.98: 3}[verifier if theta is None else theta]
        rows = []
        for question, scores in SCORES.items():
            rows.append(record(question, "baseline", 10, 2.0, 9, verifier=verifier, theta=theta, score=scores[0]))
            rows.append(record(question, verifier, 10, 1.0, 3, verifier=verifier, theta=theta, score=scores[column],
                               draft_length=draft_length))  # fmt: skip
        write_run(tmp_path / f"{index}_{verifier}_{theta}", rows)
    return gather([tmp_path])


def test_the_quality_table_pairs_every_method_with_the_strict_verifier(tmp_path):
    table = quality_table(scored_sweep(tmp_path)).set_index("method")
    assert set(table.index) == {"baseline", "mars (theta=0.9)", "mars (theta=0.98)"}
    assert (table["reference"] == "rejection").all()
    mars = table.loc["mars (theta=0.9)"]
    assert mars["prompts"] == 6
    assert mars["score"] == pytest.approx(1 / 6) and mars["reference_score"] == pytest.approx(5 / 6)
    assert mars["difference"] == pytest.approx(-4 / 6)
    # differences (-1, -1, -1, 0, -1, 0): four non-zero, all negative; 2 of 16 sign patterns are as extreme
    assert mars["p_value"] == pytest.approx(2 / 16)
    assert mars["ci_low"] <= mars["difference"] <= mars["ci_high"] <= 0
    same = table.loc["mars (theta=0.98)"]
    assert same["difference"] == 0 and same["p_value"] == 1.0


def test_the_strict_verifier_is_the_reference_also_when_its_label_names_a_draft_length(tmp_path):
    table = quality_table(scored_sweep(tmp_path, draft_length="confidence")).set_index("method")
    assert (table["reference"] == "rejection, confidence length").all()
    assert table.loc["mars (theta=0.9), confidence length", "difference"] == pytest.approx(-4 / 6)
    assert table.loc["baseline", "difference"] == pytest.approx((4 - 5) / 6)


def test_without_the_strict_verifier_the_baseline_is_the_reference(tmp_path):
    table = quality_table(scored_sweep(tmp_path, with_strict=False)).set_index("method")
    assert set(table.index) == {"mars (theta=0.9)", "mars (theta=0.98)"}
    assert (table["reference"] == "baseline").all()
    assert table.loc["mars (theta=0.98)", "difference"] == pytest.approx((5 - 4) / 6)


def test_a_setting_summary_pools_prompts_and_counts_triggers(tmp_path):
    rows = [record(0, "baseline", 10, 2.0, 9), record(1, "baseline", 30, 6.0, 29),
            record(0, "mars", 10, 1.0, 3, drafted=12, accepted=6, relaxed=2, trigger_count=3, verified_positions=9),
            record(1, "mars", 30, 2.0, 7, drafted=30, accepted=22, relaxed=1, trigger_count=1,
                   verified_positions=27)]  # fmt: skip
    write_run(tmp_path / "run", rows)
    summary = method_summary(gather([tmp_path])).iloc[0]
    assert summary["speedup"] == pytest.approx((40 / 3.0) / (40 / 8.0))
    assert summary["tau"] == pytest.approx((9 + 29) / (3 + 7))
    assert summary["acceptance_rate"] == pytest.approx(28 / 42)
    assert summary["relaxed_share"] == pytest.approx(3 / 28)
    assert summary["trigger_rate"] == pytest.approx(4 / 36)


def acceptance_rows(tmp_path):
    mars = record(0, "mars", 10, 1.0, 3, accepted_per_depth=[3, 2, 0], reached_per_depth=[3, 3, 2], drafted=9, accepted=5,
                  margins=[0.95, 0.5, 0.2, 0.91, 0.99, None], reasons=[0, 1, 3, 2, 1, 3],
                  shadow_accepted={"rejection": [1, 0, 2],
                                   "mars(theta=0.9,guard=never,correction=residual)": [2, 1, 2]})  # fmt: skip
    write_run(tmp_path / "run", [record(0, "baseline", 10, 2.0, 9), mars])
    return gather([tmp_path])


def test_alpha_per_depth_divides_accepted_by_reached(tmp_path):
    alpha = alpha_per_depth(acceptance_rows(tmp_path))
    assert alpha["alpha"].tolist() == pytest.approx([1.0, 2 / 3, 0.0])
    assert alpha["depth"].tolist() == [1, 2, 3]


def test_positions_are_binned_by_a_value_statistic_with_their_outcome(tmp_path):
    frame = acceptance_rows(tmp_path)  # a row of schema 1: its margins are the statistic margin
    assert value_statistics(frame) == ["margin"]
    table = positions(frame, "margin")
    assert table["outcome"].tolist() == ["strict accept", "relaxed accept", "rejected", "strict accept", "relaxed accept",
                                         "rejected"]  # fmt: skip
    binned = acceptance_by_value(table).sort_values("bin_low")
    assert binned["positions"].sum() == 5  # the position without a finite value is left out
    assert binned["bin_low"].iloc[0] == -np.inf and binned["bin_high"].iloc[-1] == np.inf  # deciles, open at both ends
    assert binned["positions"].iloc[0] == 1 and binned["acceptance_rate"].iloc[0] == 0  # 0.2, rejected
    assert binned["acceptance_rate"].iloc[1:].tolist() == [1.0, 1.0, 1.0, 1.0]  # 0.5, 0.91, 0.95, 0.99: one bin each
    with pytest.raises(NotEnoughData, match="no verified position carries the statistic entropy"):
        positions(frame, "entropy")


def test_the_statistics_a_verifier_declares_reach_the_tables_by_their_names(tmp_path):
    new = {"schema_version": SCHEMA_VERSION, "verifier_setting": "entropy=0.3"}
    fly = record(0, "fly", 10, 1.0, 3, verifier="fly", **new, drafted=4, accepted=3, reasons=[0, 1, 0, 3],
                 verified_positions=4, rule_counts={"gate": 2}, rule_values={"entropy": [0.1, 0.5, 0.2, None]})
    write_run(tmp_path / "run", [record(0, "baseline", 10, 2.0, 9, verifier="fly", **new), fly])
    frame = gather([tmp_path])
    assert value_statistics(frame) == ["entropy"] and positions(frame, "entropy")["value"].count() == 3
    summary = method_summary(frame).iloc[0]
    assert summary["gate_rate"] == pytest.approx(2 / 4) and "trigger_rate" not in summary
    assert list(summary.index[summary.index.get_loc("relaxed_share") + 1 :][:1]) == ["gate_rate"]


def test_the_shadow_table_reports_acceptance_on_identical_drafts(tmp_path):
    table = shadow_table(acceptance_rows(tmp_path)).set_index("shadow")
    assert table["live"].tolist() == pytest.approx([5 / 9, 5 / 9])
    assert table.loc["rejection", "shadow_acceptance"] == pytest.approx(3 / 9)
    assert table.loc["mars", "shadow_acceptance"] == pytest.approx(5 / 9)  # one mars shadow: its bare name
    assert table.loc["rejection", "live_minus_shadow"] == pytest.approx(2 / 9)


def test_shadow_labels_show_the_settings_that_differ_between_shadows_of_one_verifier():
    raw = ["mars(theta=0.84,guard=gap,correction=residual)", "mars(theta=0.9,guard=never,correction=residual)",
           "typical(epsilon=0.09,delta=0.3)", "rejection"]  # fmt: skip
    assert list(shadow_labels(raw).values()) == ["mars (theta=0.84, guard=gap)", "mars (theta=0.9, guard=never)",
                                                 "typical", "rejection"]  # fmt: skip


def test_the_pareto_front_keeps_only_unbeaten_points():
    points = pd.DataFrame({"speedup": [1.0, 1.5, 1.2, 2.0, 1.9], "score": [0.9, 0.8, 0.7, 0.5, 0.5]})
    assert pareto_front(points).index.tolist() == [0, 1, 3]


def test_the_bootstrap_cis_cover_the_true_value_at_about_95_percent():
    rng = np.random.default_rng(1)
    mean_hits = ratio_hits = 0
    repeats = 300
    for seed in range(repeats):
        differences = rng.normal(0.3, 1.0, size=40)
        low, high = bootstrap_mean_ci(differences, resamples=1000, seed=seed)
        mean_hits += low <= 0.3 <= high
        tokens = rng.integers(100, 300, size=30)
        base_seconds = tokens / 4.0 * rng.lognormal(0, 0.3, size=30)
        method_seconds = tokens / 8.0 * rng.lognormal(0, 0.3, size=30)  # the same noise law: true ratio exactly 2
        low, high = bootstrap_ratio_ci(tokens, method_seconds, tokens, base_seconds, resamples=1000, seed=seed)
        ratio_hits += low <= 2.0 <= high
    assert 0.90 <= mean_hits / repeats <= 0.99
    assert 0.90 <= ratio_hits / repeats <= 0.99


def test_the_bootstrap_intervals_resample_prompts_with_the_seed_and_take_percentiles():
    rng = np.random.default_rng(3)
    tokens, seconds, base_seconds = rng.integers(50, 200, 25), rng.lognormal(0, 0.4, 25), rng.lognormal(1, 0.4, 25)
    picks = np.random.default_rng(7).integers(0, 25, size=(2000, 25))  # prompt indices, one row per resample
    ratios = (tokens[picks].sum(1) / seconds[picks].sum(1)) / (tokens[picks].sum(1) / base_seconds[picks].sum(1))
    expected = np.percentile(ratios, [2.5, 97.5])
    assert bootstrap_ratio_ci(tokens, seconds, tokens, base_seconds, seed=7) == pytest.approx(expected, rel=1e-12)
    differences = rng.choice([-1.0, 0.0, 1.0], 25)
    expected = np.percentile(differences[picks].mean(1), [2.5, 97.5])
    assert bootstrap_mean_ci(differences, seed=7) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert bootstrap_mean_ci(differences, seed=7) == bootstrap_mean_ci(differences, seed=7)  # deterministic
    assert np.isnan(bootstrap_mean_ci([1.0])).all() and np.isnan(bootstrap_ratio_ci([1], [1.0], [1], [2.0])).all()


def test_the_paired_test_gives_the_p_values_of_scipys_permutation_test():
    from scipy.stats import permutation_test

    def scipy_p(differences, resamples):
        return permutation_test((differences,), np.sum, permutation_type="samples", vectorized=True, n_resamples=resamples,
                                rng=np.random.default_rng(0)).pvalue  # fmt: skip

    rng = np.random.default_rng(4)
    for size in (2, 5, 9, 12):  # every sign pattern, in both
        differences = rng.normal(0.4, 1.0, size)
        assert paired_permutation_p(differences) == pytest.approx(scipy_p(differences, 2**size), rel=1e-12)
    assert paired_permutation_p([1, 1, 1, 0, -1, 1]) == pytest.approx(scipy_p(np.array([1.0, 1, 1, -1, 1]), 2**5))
    differences = rng.normal(0.3, 1.0, 24)  # Monte Carlo in both: equal within their sampling error
    assert paired_permutation_p(differences) == pytest.approx(scipy_p(differences, 20000), abs=0.02)


def test_the_paired_test_holds_its_level_under_the_null():
    rng = np.random.default_rng(2)
    p_values = [paired_permutation_p(rng.normal(0, 1, size=12)) for _ in range(400)]
    assert np.mean(np.array(p_values) < 0.05) <= 0.07
    assert paired_permutation_p(np.ones(20)) < 1e-3  # Monte Carlo path: every sign agrees


@pytest.mark.slow
def test_the_command_writes_every_table_figure_and_an_index(tmp_path):
    frame_dir = tmp_path / "sweep"
    scored_sweep(frame_dir)
    out = tmp_path / "out"
    assert main([str(frame_dir), "--out", str(out)]) == 0
    made = {p.name for p in out.iterdir()}
    assert {"records.parquet", "table1.md", "table1.tex", "quality.md", "settings.csv", "threshold_ablation.png",
            "pareto.png", "index.md"} <= made  # fmt: skip
    index = (out / "index.md").read_text()
    for name in made - {"index.md"}:
        assert f"({name})" in index, name
    assert len(pd.read_parquet(out / "records.parquet")) == 36


def test_a_partial_sweep_makes_what_it_can_and_says_what_is_missing(tmp_path, capsys):
    method_only = record(0, "mars", 10, 1.0, 3, drafted=5, accepted=2, margins=[0.9], reasons=[0],
                         accepted_per_depth=[1], reached_per_depth=[1])  # fmt: skip
    write_run(tmp_path / "half", [method_only])
    out = tmp_path / "out"
    assert main([str(tmp_path / "half"), "--out", str(out)]) == 0
    index = (out / "index.md").read_text()
    assert "(settings.md)" in index  # the method's rows alone make the settings table, without a speedup
    assert "pareto: skipped, no speedup in any setting" in index
    assert "quality: skipped, no finished rows carry a score" in index
    assert "(alpha_per_depth.png)" in index  # what needs no baseline is still made
    assert "Traceback" not in capsys.readouterr().err


def test_records_from_older_writers_get_the_defaults_of_missing_fields(tmp_path):
    write_run(tmp_path / "old", [record(0, "baseline", 10, 2.0, 9), record(0, "mars", 10, 1.0, 3)])
    write_run(tmp_path / "new", [record(0, "baseline", 10, 2.0, 9), record(0, "mars", 10, 1.0, 3, draft_length="fixed")])
    assert set(method_summary(gather([tmp_path]))["label"]) == {"mars"}


def test_two_shapes_of_one_drafter_are_two_settings_and_one_shape_keeps_its_bare_name(tmp_path):
    def run(folder, setting, seconds):
        times = {"baseline": 2.0, "mars": seconds}
        rows = [record(0, method, 10, time, 9, drafter_setting=setting) for method, time in times.items()]
        write_run(tmp_path / folder, rows)

    run("small", "gamma=5,top_k=3,tree_tokens=16", 1.0)
    run("large", "gamma=7,top_k=10,tree_tokens=50", 0.5)
    speedups = dict(zip(*method_summary(gather([tmp_path]))[["drafter", "speedup"]].T.values))
    assert speedups == {"model (gamma=5,top_k=3,tree_tokens=16)": 2.0, "model (gamma=7,top_k=10,tree_tokens=50)": 4.0}
    assert set(table1(gather([tmp_path / "small"])).index.get_level_values("drafter")) == {"model"}


def test_figure_titles_keep_the_readable_drafter_name_and_its_setting():
    assert _drafter_title("model (gamma=3)") == "separate draft model (gamma=3)"
    assert _drafter_title("model_tree (top_k=3)") == "separate draft model, top-k tree (top_k=3)"
    assert _drafter_title("my_drafter") == "my_drafter"  # a drafter without a readable name keeps its own


def test_every_registered_drafter_has_a_readable_figure_name():
    from mars_bench.analysis.figures import DRAFTERS
    from mars_bench.drafting import available_drafters

    assert set(available_drafters()) <= set(DRAFTERS)


def test_records_older_than_drafter_setting_are_told_apart_by_gamma(tmp_path):
    write_run(tmp_path / "a", [record(0, "baseline", 10, 2.0, 9, gamma=3), record(0, "mars", 10, 1.0, 3, gamma=3)])
    write_run(tmp_path / "b", [record(0, "baseline", 10, 2.0, 9, gamma=5), record(0, "mars", 10, 1.0, 3, gamma=5)])
    # no gamma: the column turns float (with a finished row: a folder that never decoded is left out)
    write_run(tmp_path / "c", [record(1, "baseline", 10, 2.0, 9), record(1, "mars", 0, 0.0, 0, status="failed")])
    new = [record(0, m, 10, 2.0, 9, gamma=5, drafter_setting="gamma=5") for m in ("baseline", "mars")]
    write_run(tmp_path / "d", new)  # a newer writer, same setting as "b"
    frame = gather([tmp_path])
    assert set(method_summary(frame)["drafter"]) == {"model (gamma=3)", "model (gamma=5)"}
    assert set(frame["drafter"]) == {"model (gamma=3)", "model (gamma=5)", "model"}  # the failed row: setting unknown


def test_an_empty_or_missing_sweep_gives_a_clear_message(tmp_path, capsys):
    with pytest.raises(NoRecordsError, match="no records.jsonl with finished rows below"):
        gather([tmp_path])
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "analysis: error: folder" in capsys.readouterr().err
    write_run(tmp_path / "failed", [record(0, "mars", 0, 0.0, 0, status="failed")])
    with pytest.raises(NoRecordsError, match="folders that hold only failures: 1"):  # a folder that never decoded
        gather([tmp_path])
    write_run(tmp_path / "baseline", [record(0, "baseline", 10, 2.0, 9), record(0, "mars", 0, 0.0, 0, status="failed")])
    with pytest.raises(NotEnoughData, match="no finished method rows"):
        method_summary(gather([tmp_path]))


@pytest.mark.parametrize("package", ["analysis", "mars_bench.analysis"])  # in a checkout; installed
@pytest.mark.slow
def test_analysis_never_imports_torch(package):
    code = f"import sys, {package}.__main__; assert 'torch' not in sys.modules, 'torch was imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_a_run_without_shadows_is_written_to_parquet_whole(tmp_path):
    rows = [record(q, m, 10, 2.0 if m == "baseline" else 1.0, 3, shadow_accepted={}, schema_version=4,
                   verifier_setting="theta=0.9") for q in (0, 1) for m in ("baseline", "mars")]  # fmt: skip
    write_run(tmp_path / "run", rows)
    out = tmp_path / "out"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    parquet = pd.read_parquet(out / "records.parquet")
    assert len(parquet) == 4 and set(parquet["shadow_accepted"]) == {"{}"}  # mappings as JSON text
    assert not [p for p in out.iterdir() if "partial" in p.name]


def test_a_verifier_without_a_trigger_has_no_trigger_rate_and_older_rows_keep_their_margins(tmp_path):
    strict = [record(0, "baseline", 10, 2.0, 9, verifier="rejection", theta=None, schema_version=4, verifier_setting=""),
              record(0, "rejection", 10, 1.0, 3, verifier="rejection", theta=None, schema_version=4, verifier_setting="",
                     trigger_count=None, verified_positions=4, margins=[0.95, 0.5, 1.2, 0.92], nonpositive_top1=1)]  # fmt: skip
    old = [record(0, "baseline", 10, 2.0, 9, verifier="rejection", theta=None),
           record(0, "rejection", 10, 1.0, 3, verifier="rejection", theta=None, trigger_count=2, verified_positions=4,
                  margins=[0.95, 0.5, 1.2, 0.92], nonpositive_top1=1)]  # fmt: skip
    write_run(tmp_path / "new", strict)
    write_run(tmp_path / "old", old)  # schema 3 and older counted the paper's rule for every verifier
    frame = gather([tmp_path])
    summary = method_summary(frame).iloc[0]
    assert "trigger_rate" not in summary and "margin_over_0.9" not in summary
    assert summary["nonpositive_top1_rate"] == pytest.approx(2 / 8)  # what their writers counted for every verifier
    method = frame[frame["method"] == "rejection"]
    assert [values["margin"] for values in method["rule_values"]] == [[0.95, 0.5, 1.2, 0.92]] * 2
    assert not {"margins", "trigger_count", "nonpositive_top1"} & set(frame.columns)  # read in one place, then gone


def test_the_index_gives_its_command_without_this_machines_folders(tmp_path):
    scored_sweep(tmp_path / "ablation")
    assert main([str(tmp_path / "ablation"), "--out", str(tmp_path / "ablation" / "analysis")]) == 0
    index = (tmp_path / "ablation" / "analysis" / "index.md").read_text()
    assert "`python -m mars_bench.analysis RUNS/ablation --out RUNS/ablation/analysis`" in index  # as installed
    assert str(tmp_path) not in index


def test_old_and_new_records_of_one_setting_pool_when_the_manifest_describes_the_verifier(tmp_path):
    mars = {"name": "mars", "theta": 0.9, "guard": "never", "correction": "residual"}  # the old writer's describe()
    described = {"methods": {"baseline": {"verifier": None}, "mars": {"verifier": mars}}}
    write_run(tmp_path / "old", [record(0, "baseline", 10, 2.0, 9), record(0, "mars", 10, 1.0, 3)])  # schema 3: no setting
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(described))
    new = [record(1, m, 10, 2.0 if m == "baseline" else 0.5, 9 if m == "baseline" else 3, schema_version=4,
                  verifier_setting="theta=0.9,guard=never,correction=residual") for m in ("baseline", "mars")]  # fmt: skip
    write_run(tmp_path / "new", new)
    summary = method_summary(gather([tmp_path]))
    assert len(summary) == 1 and summary.iloc[0]["prompts"] == 2 and summary.iloc[0]["label"] == "mars"


def test_the_strict_rule_has_one_home_that_names_registered_verifiers():
    from mars_bench.common.strict_rule import strict_verifier
    from mars_bench.verification import available_verifiers

    assert (strict_verifier(0.0), strict_verifier(0.7)) == ("exact", "rejection")
    assert {"exact", "rejection"} <= set(available_verifiers())


def app_written_run(folder: Path, scores: dict[str, float], *overrides: str) -> None:
    """A run folder whose rows carry exactly the keys the app writes for ``python -m mars_bench OVERRIDES``
    (bench.cell.cell_keys over the composed config): two prompts, a baseline and a mars row each."""
    from conftest import run_config

    from mars_bench.bench.cell import cell_keys
    from mars_bench.bench.records import Record, RecordWriter
    from mars_bench.config.method import method_spec

    cfg = run_config("experiment=smoke", *overrides)
    keys = cell_keys(cfg, "c", method_spec(cfg))
    writer = RecordWriter(folder)
    for question in (0, 1):
        for method, seconds in (("baseline", 2.0), ("mars", 1.0)):
            writer.write(Record(**keys, question_id=question, category="", turn=1, method=method,
                                new_tokens=10, steps=9 if method == "baseline" else 3, decode_s=seconds,
                                score=scores[method]))  # fmt: skip


def test_runs_that_differ_only_in_max_new_tokens_neither_pool_nor_pair_across(tmp_path):
    app_written_run(tmp_path / "long", {"baseline": 1.0, "mars": 1.0}, "max_new_tokens=24")
    app_written_run(tmp_path / "short", {"baseline": 0.0, "mars": 0.0}, "max_new_tokens=12")
    frame = gather([tmp_path])
    summary = method_summary(frame).set_index("label")
    assert sorted(summary.index) == ["mars, max_new_tokens=12", "mars, max_new_tokens=24"]  # two settings, not one
    assert (summary["prompts"] == 2).all() and (summary["speedup"] == 2.0).all()
    quality = quality_table(frame, include_cut=True).set_index("method")  # each mars vs the baseline of its own budget
    assert sorted(quality.index) == ["mars, max_new_tokens=12", "mars, max_new_tokens=24"]
    assert (quality["reference"] == "baseline").all() and (quality["prompts"] == 2).all()
    assert quality["reference_score"].to_dict() == {"mars, max_new_tokens=12": 0.0, "mars, max_new_tokens=24": 1.0}
    assert (quality["difference"] == 0).all()
    alone = method_summary(gather([tmp_path / "long"]))
    assert alone["label"].tolist() == ["mars"]  # one run alone: nothing to tell apart, the bare name


def test_old_records_take_the_conditions_they_lack_from_their_manifest(tmp_path):
    from conftest import run_config
    from omegaconf import OmegaConf

    app_written_run(tmp_path / "new", {"baseline": 1.0, "mars": 1.0}, "max_new_tokens=24")
    rows = [json.loads(line) for line in (tmp_path / "new" / "records.jsonl").read_text().splitlines()]
    newer = ("attn_implementation", "device_map", "scorer", "threads")
    old = [{key: value for key, value in row.items() if key not in newer} | {"schema_version": 6} for row in rows]
    write_run(tmp_path / "old" / "described", old)  # the same run as schema 6 wrote it, with its manifest
    config = OmegaConf.to_container(run_config("experiment=smoke", "max_new_tokens=24"), resolve=True)
    (tmp_path / "old" / "described" / "manifest.json").write_text(json.dumps({"config": config}))
    both = method_summary(gather([tmp_path / "new", tmp_path / "old"]))
    assert both["label"].tolist() == ["mars"] and both["prompts"].tolist() == [4]  # one setting: old and new pool
    write_run(tmp_path / "old" / "bare", old)  # no manifest: its attention and scorer are unknown
    alone = method_summary(gather([tmp_path / "old" / "bare"]))
    assert alone["label"].tolist() == ["mars"] and alone["speedup"].tolist() == [2.0]  # alone it pairs as before
    labels = sorted(method_summary(gather([tmp_path]))["label"])
    assert labels == ["mars, attn_implementation=None, scorer=None", "mars, attn_implementation=sdpa, scorer=humaneval"]


@pytest.mark.slow
def test_two_real_runs_that_differ_only_in_max_new_tokens_stay_apart(tiny_target, tmp_path):
    """Two app runs (the smoke experiment on the tiny target: what is proven is the analysis of the folders
    the app writes, which holds for any model) that differ only in max_new_tokens are two settings, each
    pooled and paired as when analysed alone."""
    from conftest import SMOKE, TINY, python_m

    overrides = [item for item in SMOKE if not item.startswith("max_new_tokens=")]
    long_run, short_run = tmp_path / "long", tmp_path / "short"
    for run, tokens in ((long_run, 12), (short_run, 8)):
        done = python_m("mars_bench", *overrides, *TINY, f"max_new_tokens={tokens}", f"output_dir={run}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    frame = gather([long_run, short_run]).assign(disturbed=False)  # --include-disturbed: this machine is shared
    summary = method_summary(frame).set_index("label")
    quality = quality_table(frame, include_cut=True).set_index("method")
    for run, tokens in ((long_run, 12), (short_run, 8)):
        label = f"mars, max_new_tokens={tokens}"
        alone = method_summary(gather([run]).assign(disturbed=False)).iloc[0]  # the run analysed by itself
        assert summary.loc[label, "prompts"] == 2 and summary.loc[label, "tau"] == alone["tau"]
        assert summary.loc[label, "speedup"] == alone["speedup"] and summary.loc[label, "score"] == alone["score"]
        baselines = [row["score"] for row in read_rows(run / "records.jsonl") if row["method"] == "baseline"]
        assert quality.loc[label, "prompts"] == 2 and quality.loc[label, "reference_score"] == pytest.approx(np.mean(baselines))
    assert len(summary) == len(quality) == 2


def test_a_verifiers_settings_come_from_its_recorded_setting_and_old_records_keep_their_own(tmp_path):
    for theta in (0.84, 0.9):
        app_written_run(tmp_path / "new" / str(theta), {"baseline": 1.0, "mars": 1.0}, f"verifier.theta={theta}")
    written = json.loads((tmp_path / "new" / "0.84" / "records.jsonl").read_text().splitlines()[0])
    assert "theta" not in written and "guard" not in written and written["verifier_setting"].startswith("theta=0.84,")
    summary = method_summary(gather([tmp_path / "new"])).set_index("label")
    assert summary["theta"].to_dict() == {"mars (theta=0.84)": 0.84, "mars (theta=0.9)": 0.9}  # the setting that varies
    assert "guard" not in summary  # the same in every cell: in verifier_setting only
    old = [record(0, m, 10, 2.0 if m == "baseline" else 1.0, 3, theta=0.88, guard="never") for m in ("baseline", "mars")]
    write_run(tmp_path / "old", old)  # schema 1: theta and guard beside the verifier, no verifier_setting
    frame = gather([tmp_path / "old"])
    assert "theta" not in frame and "guard" not in frame  # read into verifier_setting, then dropped
    assert method_summary(frame)["verifier_setting"].tolist() == ["theta=0.88,guard=never"]
    both = method_summary(gather([tmp_path])).set_index("label")  # old and new records split by the same setting
    assert both["theta"].to_dict() == {"mars (theta=0.84, correction=residual)": 0.84, "mars (theta=0.88)": 0.88,
                                       "mars (theta=0.9, correction=residual)": 0.9}  # the old writer knew no correction


def test_the_pareto_figure_takes_a_ci_that_collapses_onto_its_point_a_rounding_error_away(tmp_path):
    speedup = 5.1427348799927435
    row = {"model": "qwen", "drafter": "model", "task": "humaneval", "temperature": 1.0, "verifier": "rejection",
           "verifier_setting": "", "label": "rejection", "speedup": speedup, "speedup_ci_low": speedup + 8.9e-16,
           "speedup_ci_high": speedup, "score": 0.0, "score_ci_low": 0.0, "score_ci_high": 0.0}  # fmt: skip
    assert pareto(pd.DataFrame([row]), tmp_path / "pareto.png").is_file()  # matplotlib refuses a negative error bar
