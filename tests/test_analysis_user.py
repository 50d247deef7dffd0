"""What a first-time user met in the analysis, in the user's order, on records as the app
writes them: a refused run and a repeated configuration entered the analysis silently (3); a busy
machine left nothing to read where the speedup would be (4); table1.tex, index.md and three figures
had small defects (8)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from functools import cache
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from conftest import SMOKE, figures_not_rendered, python_m, run_config
from matplotlib.ticker import NullFormatter

from mars_bench.analysis import figures
from mars_bench.analysis.acceptance import alpha_per_depth, positions
from mars_bench.analysis.cells import method_summary
from mars_bench.analysis.gather import gather, gather_runs
from mars_bench.analysis.runs import pooled_settings
from mars_bench.bench.cell import cell_keys, failure_record
from mars_bench.bench.records import Record, RecordWriter, read_rows
from mars_bench.bench.summary import write_summary
from mars_bench.config.checks import check_run_config
from mars_bench.config.method import configured_spec, method_spec

REPO = Path(__file__).resolve().parents[1]
SMOKE_OVERRIDES = [item for item in SMOKE if not item.startswith("max_new_tokens=")]
NO_SPEEDUP = "no speedup: all 2 prompts were disturbed; rerun on an idle machine, or pass `{option}`"


@cache
def keys(*overrides: str) -> dict:
    """The keys every record of ``python -m mars_bench experiment=smoke OVERRIDES`` carries (bench.cell.cell_keys)."""
    cfg = run_config("experiment=smoke", *overrides)
    return cell_keys(cfg, "c", method_spec(cfg))


def write_rows(folder: Path, questions, *overrides: str, disturbed: bool = False) -> None:
    """Rows as the app writes them for ``OVERRIDES``: per question a baseline (2 s) and a mars row (1 s),
    10 tokens each, with drafts, the margin rule's statistics and reasons; appended where the folder has records (a resume)."""
    writer = RecordWriter(folder)
    for question in questions:
        writer.write(Record(**keys(*overrides), question_id=question, category="", turn=1, method="baseline", new_tokens=10,
                            steps=9, decode_s=2.0, score=1.0, disturbed=disturbed))  # fmt: skip
        writer.write(Record(**keys(*overrides), question_id=question, category="", turn=1, method="mars", new_tokens=10,
                            steps=3, decode_s=1.0, score=1.0, disturbed=disturbed, drafted=12, accepted=6,
                            accepted_per_depth=[3, 2, 1], reached_per_depth=[3, 3, 2], reasons=[0, 1, 0, 3],
                            verified_positions=4, rule_counts={"trigger": 1, "nonpositive_top1": 0},
                            rule_values={"margin": [0.2, 0.95, 0.6, 0.99]}))  # fmt: skip


def refuse(folder: Path, *overrides: str) -> str:
    """A run the app refuses for a bad value, left as the app leaves it (mars_bench.__main__: the cell's
    config check raises, and one failure row says why); the error as that row records it."""
    cfg = run_config(*SMOKE_OVERRIDES, *overrides)
    with pytest.raises(ValueError) as refused:
        check_run_config(cfg)
    RecordWriter(folder).write(failure_record(cfg, ",".join(overrides), configured_spec(cfg), refused.value))
    return f"ValueError: {refused.value}"


def write_frame(folder: Path, rows: list[dict]) -> Path:
    """``rows`` as a run folder's records.jsonl."""
    folder.mkdir(parents=True)
    (folder / "records.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def analyse(cwd: Path, monkeypatch, *argv: str, pictures: bool = False):
    """``python -m analysis ARGV`` typed in ``cwd`` (the repository's analysis/, as from a clone). Its
    figures are drawn but, unless ``pictures``, not rendered to PNG: the tests that read its text need
    no pixels, and rendering is most of an analysis's time."""
    monkeypatch.syspath_prepend(str(REPO))
    with contextlib.nullcontext() if pictures else figures_not_rendered():
        return python_m("analysis", *argv, cwd=cwd)


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures the analysis draws in this test, kept open to be inspected."""
    figures_drawn = []

    def keep(figure, path):
        figures_drawn.append(figure)
        return path

    monkeypatch.setattr(figures, "_save", keep)
    yield figures_drawn
    for figure in figures_drawn:
        plt.close(figure)


# 3. Failed and duplicate runs enter the analysis silently.


@pytest.mark.slow
def test_a_folder_with_a_refused_run_and_a_repeated_run_is_refused_then_pooled_only_when_asked(smoke_run, tmp_path, monkeypatch):
    result, run = smoke_run
    assert result.returncode == 0, result.stderr
    runs = tmp_path / "runs"
    shutil.copytree(run, runs / "first")
    shutil.copytree(run, runs / "again")  # the same command run again: the same prompts of one configuration
    error = refuse(runs / "refused", "max_new_tokens=0")
    rows = list(read_rows(run / "records.jsonl"))

    refused = analyse(tmp_path, monkeypatch, "runs", pictures=True)
    assert refused.returncode == 2
    assert f"analysis: left out runs/refused: none of its rows decoded ({error})" in refused.stderr.splitlines()
    assert [line for line in refused.stderr.splitlines() if "error" in line and "left out" not in line] == [
        "analysis: error: 2 run folders measured the same 2 prompts of mars on humaneval (smollm2-135m, layerskip, T=1): "
        "`runs/again`, `runs/first`; analyse one of them, or pass --pool-repeats to pool them (each measurement of a "
        "prompt then counts as a prompt)"
    ]
    assert not (tmp_path / "analysis_out").exists()  # refused before anything is written

    pooled = analyse(tmp_path, monkeypatch, "runs", "--pool-repeats", pictures=True)
    assert pooled.returncode == 0, pooled.stderr
    out = tmp_path / "analysis_out"
    index = (out / "index.md").read_text()
    assert "Made by `python -m analysis runs --pool-repeats`." in index
    assert f"- `runs/refused`: 1 failed row, first: {error}" in index
    assert ("- mars on humaneval (smollm2-135m, layerskip, T=1): 2 prompts from `runs/again`, `runs/first`; 2 of them "
            "measured in more than one folder, each measurement counted as a prompt (--pool-repeats)") in index  # fmt: skip
    assert f"all {2 * len(rows)} records, gathered from 2 run folders." in index
    records = pd.read_parquet(out / "records.parquet")
    assert (records["status"] == "ok").all() and set(records["max_new_tokens"]) == {12}  # the refused run left out
    settings = pd.read_csv(out / "settings.csv")
    assert settings["label"].tolist() == ["mars"]  # not "mars, max_new_tokens=12": the refused run's value varies nothing
    assert settings["prompts"].tolist() == [4] and settings["run_folders"].tolist() == [2]  # both runs', as index.md says


def test_a_sharded_run_pools_without_asking_and_is_listed_and_a_resumed_run_is_one_folder(tmp_path, monkeypatch):
    write_rows(tmp_path / "runs" / "shard0", [0, 1])  # one setting, two machines, disjoint prompts
    write_rows(tmp_path / "runs" / "shard1", [2, 3])
    write_rows(tmp_path / "runs" / "resumed", [0], "verifier.theta=0.8")  # interrupted, then resumed into its folder
    write_rows(tmp_path / "runs" / "resumed", [1], "verifier.theta=0.8")
    done = analyse(tmp_path, monkeypatch, "runs")
    assert done.returncode == 0, done.stderr
    index = (tmp_path / "analysis_out" / "index.md").read_text()
    pooled = [line for line in index.splitlines() if " from `" in line]
    assert pooled == ["- mars (theta=0.9) on humaneval (smollm2-135m, layerskip, T=1): 4 prompts from `runs/shard0`, "
                      "`runs/shard1`; none measured twice (a sharded or continued run)"]  # fmt: skip
    settings = pd.read_csv(tmp_path / "analysis_out" / "settings.csv").set_index("label")
    assert settings["prompts"].to_dict() == {"mars (theta=0.8)": 2, "mars (theta=0.9)": 4}
    assert [entry.folders for entry in pooled_settings(gather([tmp_path / "runs" / "resumed"]))] == []


def test_a_sweep_cell_that_never_decoded_is_left_out_and_named_and_only_failures_give_a_clear_error(tmp_path):
    write_rows(tmp_path / "sweep" / "0", [0, 1])
    error = refuse(tmp_path / "sweep" / "1", "verifier.theta=2")
    gathered = gather_runs([tmp_path / "sweep"])
    assert [(Path(left.folder).name, left.rows, left.error) for left in gathered.left_out] == [("1", 1, error)]
    assert set(gathered.frame["run_dir"].map(lambda folder: Path(folder).name)) == {"0"}
    from mars_bench.analysis.gather import NoRecordsError

    with pytest.raises(NoRecordsError, match=re.escape(f"folders that hold only failures: 1 (first: {error})")):
        gather([tmp_path / "sweep" / "1"])


# 4. A busy machine leaves the user with nothing to read.


@pytest.mark.slow
def test_an_all_disturbed_run_says_why_where_the_speedup_would_be(smoke_run, tmp_path, monkeypatch):
    result, run = smoke_run
    assert result.returncode == 0, result.stderr
    busy = tmp_path / "busy"
    rows = [{**row, "disturbed": True} for row in read_rows(run / "records.jsonl")]  # the run, timed on a busy machine
    write_frame(busy, rows)
    terminal = write_summary(rows, busy)  # what the app prints at the end of the run
    assert "-x [-, -]" not in terminal
    for method in ("baseline", "mars"):
        assert f"| {method} | 2 | 2 | - | {NO_SPEEDUP.format(option='include_disturbed=true')} |" in terminal
    summary = pd.read_csv(busy / "summary.csv")
    assert summary["speedup_note"].tolist() == [NO_SPEEDUP.format(option="include_disturbed=true")] * 2

    done = analyse(tmp_path, monkeypatch, "busy", pictures=True)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "analysis_out"
    reason = "every prompt was disturbed; rerun on an idle machine, or pass `--include-disturbed`"
    assert f"analysis: no speedup in any setting: {reason}" in done.stderr.splitlines()
    index = (out / "index.md").read_text()
    assert f"No speedup in any setting: {reason}." in index.splitlines()
    assert f"- pareto: skipped, no speedup in any setting: {reason}." in index.splitlines()
    assert f"| {NO_SPEEDUP.format(option='--include-disturbed')} |" in (out / "settings.md").read_text()
    assert pd.read_csv(out / "settings.csv")["disturbed"].tolist() == [2]

    counted = analyse(tmp_path, monkeypatch, "busy", "--out", "counted", "--include-disturbed", pictures=True)
    assert counted.returncode == 0, counted.stderr
    settings = pd.read_csv(tmp_path / "counted" / "settings.csv")
    assert settings["disturbed"].tolist() == [2]  # still counted, though the speedup now includes them (it read 0)
    assert settings["speedup"].notna().all() and settings["speedup_note"].isna().all()
    assert "pareto.png" in (tmp_path / "counted" / "index.md").read_text()


@pytest.mark.parametrize("included", [False, True])
def test_the_threshold_ablation_says_why_its_speedup_panel_is_empty_and_draws_y_1(tmp_path, drawn, included):
    for theta in (0.8, 0.95):
        write_rows(tmp_path / str(theta), [0, 1], f"verifier.theta={theta}", disturbed=True)
    summary = method_summary(gather([tmp_path]), include_disturbed=included)
    assert summary["disturbed"].tolist() == [2, 2]
    figures.threshold_ablation(summary, tmp_path / "threshold_ablation.png")
    speed = drawn[0].axes[0]
    assert any(list(line.get_ydata()) == [1.0, 1.0] and line.get_label() == "AR baseline (1x)" for line in speed.lines)
    low, high = speed.get_ylim()
    assert low < 1.0 - 0.04 * (high - low) and 1.0 < high  # the 1x line inside the panel, clear of its edge
    texts = [" ".join(text.get_text().split()) for text in speed.texts]
    if included:
        assert texts == [] and summary["speedup"].tolist() == [2.0, 2.0]
    else:
        assert texts == ["no speedup in any setting: every prompt was disturbed; rerun on an idle machine, or pass "
                         "`--include-disturbed`"]  # fmt: skip


# 8. Small output defects.


def test_table1_tex_prints_what_the_markdown_shows_and_no_nan(tmp_path, monkeypatch):
    write_rows(tmp_path / "runs" / "busy", [0, 1], disturbed=True)  # no speedup: the Markdown shows "-"
    write_rows(tmp_path / "runs" / "quiet", [0, 1], "task=gsm8k")
    assert analyse(tmp_path, monkeypatch, "runs").returncode == 0
    latex = (tmp_path / "analysis_out" / "table1.tex").read_text()
    markdown = (tmp_path / "analysis_out" / "table1.md").read_text()
    assert "nan" not in latex and "1.000000" not in latex
    # gsm8k: 2x; humaneval: none (disturbed); Mean: none, as a mean over fewer tasks than the other rows' would mislead
    # finished_share "-": these rows, as older writers wrote them, do not say how their answers ended
    assert ("| smollm2-135m | layerskip | 1.00 | mars | 2.00x | 3.00 | 3.00 | - | - | 3.00 | 3.00 | - | - | 3.00 | 3.00 "
            "| - |") in markdown
    assert ("smollm2-135m & layerskip & 1.00 & mars & 2.00 & 3.00 & 3.00 & -- & -- & 3.00 & 3.00 & -- & -- & 3.00 & 3.00 "
            "& -- \\\\") in latex
    assert markdown.split("\n\n")[1:] == [  # under the table: what finished_share is, why a speedup is missing
        "finished_share: the share of the method's answers that ended on a stop token or string, not at max_new_tokens.",
        "`-`: no value. Where a speedup is missing:",
        f"- mars on humaneval (smollm2-135m, layerskip, T=1): {NO_SPEEDUP.format(option='--include-disturbed')}",
        "A Mean is empty where one of its tasks is.\n",
    ]
    assert "tau\\_request\\_mean" in latex and "tau_request_mean" not in latex  # names escaped: the file compiles


def test_the_index_gives_the_command_as_typed_and_counts_one_run_folder(tmp_path, monkeypatch):
    write_rows(tmp_path / "runs" / "2026-12-02" / "01-23-26", [0, 1])
    assert analyse(tmp_path, monkeypatch, "runs").returncode == 0
    index = (tmp_path / "analysis_out" / "index.md").read_text()
    assert "Made by `python -m analysis runs`." in index
    assert "- [records.parquet](records.parquet): all 4 records, gathered from 1 run folder." in index
    assert analyse(tmp_path, monkeypatch, "runs/", "--out=report", "--include-disturbed").returncode == 0
    assert "Made by `python -m analysis runs --out=report --include-disturbed`." in (tmp_path / "report" / "index.md").read_text()


def test_alpha_per_depth_shows_counts_and_intervals_on_an_axis_that_reaches_1(tmp_path, drawn):
    write_rows(tmp_path / "run", range(6))
    rows = list(read_rows(tmp_path / "run" / "records.jsonl"))
    for index, row in enumerate(row for row in rows if row["method"] == "mars"):  # prompts that accept differently
        row["accepted_per_depth"] = [3 - index % 2, 1 + index % 2, index % 3]
    alpha = alpha_per_depth(gather([write_frame(tmp_path / "varied", rows)]))
    assert alpha["reached"].tolist() == [18, 18, 12] and alpha["prompts"].tolist() == [6, 6, 6]
    assert alpha["accepted"].tolist() == [15, 9, 6] and alpha["alpha"].tolist() == pytest.approx([15 / 18, 9 / 18, 6 / 12])
    assert (alpha["alpha_ci_low"] <= alpha["alpha"]).all() and (alpha["alpha"] <= alpha["alpha_ci_high"]).all()
    assert (alpha["alpha_ci_high"] > alpha["alpha_ci_low"]).all()
    figures.alpha_by_depth(alpha, tmp_path / "alpha_per_depth.png")
    rate, counts = drawn[0].axes
    low, high = rate.get_ylim()
    assert high == pytest.approx(1.01) and alpha["alpha_ci_low"].min() - 0.1 < low <= alpha["alpha_ci_low"].min()
    assert [line.get_ydata().tolist() for line in counts.lines] == [[18, 18, 12]]
    assert len(rate.collections) >= 1  # the error bars


def test_statistic_histogram_ticks_are_plain_counts(tmp_path, drawn):
    write_rows(tmp_path / "run", range(3))
    figures.value_histograms(positions(gather([tmp_path / "run"]), "margin"), "margin", tmp_path / "margin_histograms.png")
    axis = drawn[0].axes[0]
    low, high = axis.get_ylim()
    labels = [label.get_text() for label in axis.get_yticklabels() if low <= label.get_position()[1] <= high]
    assert labels == ["1", "2", "5", "10"]  # counts of 3 on a log axis that spans a decade: plain numbers, not 2×10⁰
    assert isinstance(axis.yaxis.get_minor_formatter(), NullFormatter)
