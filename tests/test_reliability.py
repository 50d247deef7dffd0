"""Crash-safe runs: SIGKILL at every kind of point a kill can leave the records in, then resume;
failure rows that let a sweep go on, concurrent cells that never share files, and identical
records for identical runs."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict
from functools import partial
from pathlib import Path

import pytest
from conftest import TINY, TINY_TARGET, app, run_config, run_main, without_times

from mars_bench.bench.cell import run_cell
from mars_bench.bench.failures import failure_line
from mars_bench.bench.records import read_rows
from mars_bench.bench.summary import summarise
from mars_bench.common.settings import parse_setting
from mars_bench.tasks import SCORERS

SMALL = ["experiment=smoke", "task.num_prompts=3", "max_new_tokens=8", "warmup=0", "progress=false"]
RUN = [*SMALL, *TINY]  # the runs here test the harness around the decodes: a tiny target (conftest.tiny_target)
# 2 questions x (baseline, mars) = 4 rows; the second question decodes the method first. The killed runs
# (forked, so on one thread: conftest.OwnedProcesses.start_fork) and the in-process runs use 1 thread
# alike, so that their bf16 sums are added up alike on any machine.
CELL = [*RUN, "task.num_prompts=2", "threads=1"]
GREEDY = [*CELL, "temperature=0"]


def killed_app(where: str, count: int, overrides: list[str]) -> int:
    """``python -m mars_bench OVERRIDES...`` that SIGKILLs itself at an exact point, for a forked
    child (``processes.fork``: the patches below stay in it):
      load     as the target model loads (no row yet)
      after N  right after the write that flushed the N-th row of records.jsonl
      in N     halfway through writing the N-th row (a batch's rows are one write): what a kill inside
               the write leaves on disk"""
    from mars_bench.backends import hf
    from mars_bench.bench import cell, records

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def write_then_die(self, batch, write_many=records.RecordWriter.write_many):
        if where == "in" and len(self.rows) < count <= len(self.rows) + len(batch):
            lines = [json.dumps(asdict(record)) + "\n" for record in batch]  # the rows of one write (a batch's)
            cut = count - len(self.rows) - 1
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("".join(lines[:cut]) + lines[cut][: len(lines[cut]) // 2])
                handle.flush()
                os.fsync(handle.fileno())
            die()
        rows = write_many(self, batch)
        if where == "after" and len(self.rows) >= count:
            die()
        return rows

    if where == "load":
        cell.forget_loaded_models()  # the models this process loaded already: the target loads afresh
        hf.load_model = die  # the transformers backend's loader (mars_bench/backends/hf.py)
    records.RecordWriter.write_many = write_then_die
    return run_main("mars_bench", *overrides)


# (where, N, complete rows on disk after the kill, what the point shows)
KILL_POINTS = [
    ("load", 0, 0, "during model loading, before any row"),
    ("after", 1, 1, "mid-question: question 0's baseline written, its method row not yet decoded"),
    ("after", 3, 3, "mid-question: question 1 decoded its method row first; held back for the baseline, it is lost"),
    ("in", 4, 3, "mid-row: half of the 4th line on disk"),
]


def rows_by_key(folder: Path) -> dict[tuple, dict]:
    return {(r["question_id"], r["turn"], r["method"]): r for r in read_rows(folder / "records.jsonl")}


def run_in_process(overrides: list[str], folder: Path) -> dict[tuple, dict]:
    """One uninterrupted cell, named as the app names it (its overrides but output_dir)."""
    run_cell(run_config(*overrides), folder, name=",".join(overrides))
    return rows_by_key(folder)


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, tiny_target) -> dict[str, dict[tuple, dict]]:
    """temperature -> the records of one uninterrupted in-process run of CELL (made on first use)."""

    class Runs(dict):
        def __missing__(self, temperature: str) -> dict[tuple, dict]:
            self[temperature] = run_in_process([*CELL, f"temperature={temperature}"], tmp_path_factory.mktemp("first"))
            return self[temperature]

    return Runs()


@pytest.mark.slow
def test_sigkill_at_each_kind_of_point_then_resume_loses_and_duplicates_nothing(tmp_path, first_runs, processes):
    uninterrupted = first_runs["0"]  # first: the forked runs below share the model it loads
    out = tmp_path / "killed"
    records = out / "records.jsonl"
    before: list[str] = []  # the complete lines on disk before this start
    for where, count, complete, point in KILL_POINTS:
        killed = processes.fork(partial(killed_app, where, count, [*GREEDY, f"output_dir={out}"]))
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)  # the kill landed while the run was alive
        text = records.read_text() if records.exists() else ""
        lines = text.splitlines(keepends=True)
        whole = [line for line in lines if line.endswith("\n")]
        assert whole[: len(before)] == before, point  # resuming kept every finished row as it was
        keys = [(r["question_id"], r["turn"], r["method"]) for r in read_rows(records)]
        assert len(whole) == len(keys) == len(set(keys)) == complete, point
        assert (len(lines) > len(whole)) == (where == "in"), point  # only a kill inside a write leaves a partial line
        before = whole
    run_in_process(GREEDY, out)  # the last resume runs to the end; the killed starts above resumed as the app does
    lines = records.read_text().splitlines(keepends=True)
    assert lines[: len(before)] == before  # the partial 4th line was cut, nothing before it
    keys = [(r["question_id"], r["turn"], r["method"]) for r in read_rows(records)]
    assert len(lines) == len(keys) == len(set(keys)) == 4
    resumed = rows_by_key(out)
    assert resumed.keys() == uninterrupted.keys()
    for key, row in resumed.items():
        assert without_times(row) == without_times(uninterrupted[key]), key


# At batch_size 4: 4 questions, one batch per method, each batch's 4 rows written in one write.
BATCH_OF_FOUR = [*GREEDY, "task.num_prompts=4", "batch_size=4"]
BATCH_KILL_POINTS = [
    ("after", 4, 4, "the baseline's batch written, the method's not yet decoded"),
    ("in", 6, 5, "mid-batch: the method's batch half written (one whole row, then half a row)"),
]


@pytest.mark.slow
def test_a_killed_run_at_batch_size_4_resumes_losing_and_duplicating_nothing(tmp_path, processes, tiny_target):
    uninterrupted = run_in_process(BATCH_OF_FOUR, tmp_path / "whole")
    out = tmp_path / "killed"
    records = out / "records.jsonl"
    for where, count, complete, point in BATCH_KILL_POINTS:
        killed = processes.fork(partial(killed_app, where, count, [*BATCH_OF_FOUR, f"output_dir={out}"]))
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        keys = [(r["question_id"], r["turn"], r["method"]) for r in read_rows(records)]
        assert len(keys) == len(set(keys)) == complete, point
    run_in_process(BATCH_OF_FOUR, out)  # decodes the method's batch again whole, writes its 3 missing rows
    keys = [(r["question_id"], r["turn"], r["method"]) for r in read_rows(records)]
    assert len(records.read_text().splitlines()) == len(keys) == len(set(keys)) == 8
    resumed = rows_by_key(out)
    assert resumed.keys() == uninterrupted.keys()
    for key, row in resumed.items():
        assert row["batch_rows"] == 4 and row["batch_size"] == 4, key  # every row was timed in its batch of 4
        assert without_times(row) == without_times(uninterrupted[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("temperature", ["0", "1.0"], ids=["greedy", "sampled"])
def test_identical_runs_give_identical_records(tmp_path, first_runs, temperature):
    a, b = first_runs[temperature], run_in_process([*CELL, f"temperature={temperature}"], tmp_path)
    assert a.keys() == b.keys() and len(a) == 4
    for key in a:
        assert without_times(a[key]) == without_times(b[key]), key


@pytest.mark.slow
def test_a_failing_scorer_becomes_a_failure_row_and_the_cell_goes_on(tmp_path, monkeypatch, tiny_target):
    def explode(answer, question, **context):
        if question.question_id == 0:
            raise ZeroDivisionError("scorer bug")
        return 1.0

    monkeypatch.setitem(SCORERS, "explode", explode)
    rows = run_cell(run_config(*RUN, "task.scorer=explode"), tmp_path)
    failed = [r for r in rows if r["status"] == "failed"]
    assert {(r["question_id"], r["method"]) for r in failed} == {(0, "baseline"), (0, "mars")}
    assert all(r["error"] == "ZeroDivisionError: scorer bug" for r in failed)
    assert sum(r["status"] == "ok" for r in rows) == 4
    assert failure_line(rows).startswith("2 of 6 rows failed")
    assert set(summarise(rows)["prompts"]) == {2}


def test_a_single_run_with_failures_exits_non_zero(tmp_path):
    result = app(*SMALL, "model.target=/no/such/model", f"output_dir={tmp_path}")
    assert result.returncode == 2 and "model '/no/such/model' not found" in result.stderr
    row = next(read_rows(tmp_path / "records.jsonl"))
    assert row["status"] == "failed" and row["question_id"] == "*"


@pytest.mark.slow
def test_a_sweep_goes_on_past_a_model_that_will_not_load(tmp_path, tiny_target):
    result = app(
        "-m",
        *SMALL,
        "task.num_prompts=1",
        "drafter.layers=2",
        f"model.target=/no/such/model,{TINY_TARGET}",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 3
    assert "2 cells, 1 with failures" in result.stderr
    broken, working = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [r["status"] for r in read_rows(broken / "records.jsonl")] == ["failed"]
    assert {r["status"] for r in read_rows(working / "records.jsonl")} == {"ok"}


@pytest.mark.slow
def test_concurrent_cells_never_write_into_each_other(tmp_path, processes, tiny_target):
    result = processes.fork_app(
        "-m",
        *RUN,
        "threads=1",  # one torch thread per job: the two jobs share the cores without oversubscribing them
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "verifier.theta=0.5,0.9",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    cells = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(cells) == 2
    for cell, theta in zip(cells, (0.5, 0.9)):
        rows = list(read_rows(cell / "records.jsonl"))
        assert len(rows) == 6 and {parse_setting(r["verifier_setting"])["theta"] for r in rows} == {theta}
        assert {r["cell"] for r in rows} == {rows[0]["cell"]}
