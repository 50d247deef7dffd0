"""The app at ``batch_size`` B > 1 (``bench/batches.py``): a cell decodes its prompts B at a time, the
baseline too; its records say which batch each row was in, the batch's wall time and the row's own
finish; the summary reports throughput (a batch's tokens over its time) and per-request latency, each
against the baseline at the same B. Bad values are refused in one line before any model loads."""

from __future__ import annotations

import pytest
from conftest import TINY, TINY_TARGET, app, python_m, run_config

from mars_bench.bench.cell import run_cell
from mars_bench.bench.records import read_rows
from mars_bench.bench.summary import format_table, summarise

# MT-bench: two turns, so turn 2 of a batch is conditioned on each question's own turn-1 answer.
BATCHED = ["experiment=smoke", *TINY, "drafter=lookup", "task=mt_bench", "task.num_prompts=5", "max_new_tokens=8",
           "warmup=0", "progress=false", "threads=1", "temperature=0"]  # fmt: skip


@pytest.fixture(scope="module")
def batched_rows(tmp_path_factory, tiny_target):
    """batch size -> the records of one greedy cell (5 questions, 2 turns, baseline and mars), made on first use."""

    class Runs(dict):
        def __missing__(self, size: int):
            folder = tmp_path_factory.mktemp(f"b{size}")
            extra = ["shadow=[rejection,top_m]", "fidelity=true"]
            self[size] = run_cell(run_config(*BATCHED, *extra, f"batch_size={size}"), folder)
            return self[size]

    return Runs()


def by_key(rows):
    return {(str(r["question_id"]), r["turn"], r["method"]): r for r in rows}


@pytest.mark.slow  # over a second with its fixture
def test_a_cell_at_batch_2_decodes_what_it_decodes_one_at_a_time_and_says_which_batch_each_row_was_in(batched_rows):
    alone, together = by_key(batched_rows[1]), by_key(batched_rows[2])
    assert alone.keys() == together.keys() and len(together) == 5 * 2 * 2
    for key, row in together.items():
        assert row["status"] == "ok", row["error"]
        assert row["output_ids"] == alone[key]["output_ids"], key  # fp32 greedy: token for token
        assert row["step_accepted"] == alone[key]["step_accepted"], key
        assert row["shadow_accepted"] == alone[key]["shadow_accepted"], key
        assert row["batch_size"] == 2 and alone[key]["batch_size"] == 1
    # questions 0-1, 2-3 and 4 (the last chunk holds one), per turn
    questions = list(dict.fromkeys(str(r["question_id"]) for r in batched_rows[1]))  # in the cell's order
    rows = [together[(q, turn, "baseline")] for q in questions for turn in (1, 2)]
    assert [r["batch_id"] for r in rows] == ["0.1", "0.2", "0.1", "0.2", "1.1", "1.2", "1.1", "1.2", "2.1", "2.2"]
    assert [r["batch_rows"] for r in rows] == [2, 2, 2, 2, 2, 2, 2, 2, 1, 1]
    for first, second in zip(rows[0:8:2], rows[2:8:2]):  # rows of one batch share its wall time
        assert first["batch_s"] == second["batch_s"] if first["batch_id"] == second["batch_id"] else True
    for row in together.values():
        assert row["finish_s"] == pytest.approx(row["prefill_s"] + row["decode_s"])
        assert 0 < row["finish_s"] <= row["batch_s"] + 1e-9
    assert all(r["batch_s"] == r["finish_s"] and r["batch_rows"] == 1 for r in alone.values())
    assert alone[(questions[0], 1, "mars")]["batch_id"] == "0.1" and alone[(questions[3], 2, "mars")]["batch_id"] == "3.2"


@pytest.mark.slow  # over a second with its fixture
def test_the_summary_gives_throughput_and_latency_against_the_baseline_at_the_same_batch_size(batched_rows):
    rows = batched_rows[2]
    summary = summarise(rows, include_disturbed=True)  # under a parallel suite every row may be disturbed
    method = summary[summary["method"] == "mars"].iloc[0]
    ok = [r for r in rows if r["method"] == "mars"]
    base = [r for r in rows if r["method"] == "baseline"]
    batches = {r["batch_id"]: r["batch_s"] for r in ok}
    base_batches = {r["batch_id"]: r["batch_s"] for r in base}
    throughput = sum(r["new_tokens"] for r in ok) / sum(batches.values())
    assert method["tok_per_s"] == pytest.approx(throughput)  # the batches' tokens over their wall times
    base_throughput = sum(r["new_tokens"] for r in base) / sum(base_batches.values())
    assert method["speedup"] == pytest.approx(throughput / base_throughput)
    latency = sorted(r["finish_s"] for r in ok)
    assert method["latency_mean_s"] == pytest.approx(sum(latency) / len(latency))
    assert method["latency_p50_s"] == pytest.approx((latency[4] + latency[5]) / 2)
    mean_base = sum(r["finish_s"] for r in base) / len(base)
    assert method["latency_speedup"] == pytest.approx(mean_base / method["latency_mean_s"])
    assert method["batch_size"] == 2
    table = format_table(summary)
    assert "| batch size | latency mean (s) | p50 (s) | p90 (s) | latency speedup |" in table
    assert "latency" not in format_table(summarise(batched_rows[1]))  # B = 1: today's table


# The default with the smallest budget: the embedded pair's option and its CPU tuning stay (guesses, context tokens,
# vocabulary 32768, int4 weights, the confidence stop), on the tiny target drafting for itself.
SMALL_DEFAULT = [f"model.target={TINY_TARGET}", f"model.draft_model={TINY_TARGET}", "task.num_prompts=4", "max_new_tokens=8",
                 "warmup=0", "progress=false", "disturbed_load=1000"]  # fmt: skip


@pytest.mark.slow  # the tuning's vocabulary count for the tiny target's tokenizer (cached after the first run) and 8 decodes
def test_the_default_runs_at_batch_size_4_as_typed_with_its_tuning(tmp_path, tiny_target):
    result = python_m("mars_bench", "batch_size=4", *SMALL_DEFAULT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("drafter=model(length=confidence,gamma=20,draft_vocab=32768,context_vocab=True,weights=int4,guesses=3) "
            "verifier=mars") in result.stdout and "batch_size=4; tuning=cpu for CPU kind " in result.stdout
    (records,) = (tmp_path / "runs").rglob("records.jsonl")
    rows = list(read_rows(records))
    assert len(rows) == 4 * 2 and all(row["status"] == "ok" and row["batch_size"] == 4 for row in rows)
    method = [row for row in rows if row["method"] != "baseline"]
    assert {row["batch_rows"] for row in rows} == {4} and sum(sum(row["step_drafted"]) for row in method) > 0


@pytest.mark.parametrize(("override", "message"), [
    ("batch_size=0", "batch_size=0 is invalid: allowed is an integer >= 1"),
    ("batch_size=-2", "batch_size=-2 is invalid: allowed is an integer >= 1"),
    ("batch_size=2.5", "batch_size=2.5 is invalid: allowed is an integer"),
])  # fmt: skip
def test_a_bad_batch_size_is_refused_in_one_line_before_loading(override, message):
    result = app("experiment=smoke", "model.target=/nonexistent", *override.split())
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert message in lines[-1], result.stderr[-800:]
    assert "nonexistent" not in result.stderr  # refused before the target was looked for


@pytest.mark.slow  # over a second with its fixture
def test_more_rows_than_prompts_decodes_them_all_in_one_batch(batched_rows, tmp_path):
    rows = run_cell(run_config(*BATCHED, "task.num_prompts=2", "max_new_tokens=4", "batch_size=8"), tmp_path)
    assert len(rows) == 2 * 2 * 2 and all(r["status"] == "ok" and r["batch_rows"] == 2 for r in rows)


@pytest.mark.slow  # over a second
def test_the_cells_of_a_sweep_at_one_batch_size_share_each_baseline_batch(tmp_path, tiny_target):
    shared = [*BATCHED, "task.num_prompts=3", "max_new_tokens=4", "batch_size=2", f"baseline_cache={tmp_path / 'baselines'}"]
    first = run_cell(run_config(*shared, "verifier=rejection"), tmp_path / "rejection", name="rejection")
    second = run_cell(run_config(*shared, "verifier=mars"), tmp_path / "mars", name="mars")
    decoded = {(r["question_id"], r["turn"]): r for r in first if r["method"] == "baseline"}
    copied = [r for r in second if r["method"] == "baseline"]
    assert len(copied) == len(decoded) == 3 * 2
    for row in copied:
        original = decoded[(row["question_id"], row["turn"])]
        assert row["baseline_from"] == "rejection" and row["cell"] == "mars"
        assert row["output_ids"] == original["output_ids"] and row["batch_s"] == original["batch_s"]
        assert row["batch_id"] == original["batch_id"] and row["batch_rows"] == original["batch_rows"]
    other_size = run_cell(run_config(*shared[:-2], "batch_size=1", f"baseline_cache={tmp_path / 'baselines'}"),
                          tmp_path / "alone", name="alone")  # fmt: skip
    assert all(r["baseline_from"] is None for r in other_size)  # a baseline at another batch size never pairs
