"""The time a cell has left, predicted from its finished answers' lengths and speeds (bench/duration.py), and
the lines the progress bar prints with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

from mars_bench.bench import progress as progress_module
from mars_bench.bench.duration import Forecast, error_pct, forecast_of, minutes
from mars_bench.bench.progress import SHORT_LOOK, TokenProgress


def row(question: str, method: str, new_tokens: int, seconds: float = 1.0, status: str = "ok", turn: int = 1) -> dict:
    return {"question_id": question, "turn": turn, "method": method, "new_tokens": new_tokens, "status": status,
            "prefill_s": 0.0, "decode_s": seconds, "steps": new_tokens, "drafted": 0, "accepted": 0}  # fmt: skip


PLANNED = [(question, 1, method) for question in ("a", "b", "c", "d") for method in ("baseline", "mars")]


def test_nothing_is_predicted_before_the_first_answer():
    forecast = Forecast(PLANNED, budget=512)
    assert forecast.tokens_left() is None and forecast.seconds_left() is None


def test_a_row_is_expected_as_long_as_its_question_s_other_answer_else_the_mean_and_at_its_method_s_speed():
    forecast = Forecast(PLANNED, budget=512)
    forecast.finish(row("a", "baseline", 100), wall_s=50.0)  # 0.5 s a token
    forecast.finish(row("a", "mars", 120), wall_s=12.0)  # 0.1 s a token
    forecast.finish(row("b", "mars", 300), wall_s=30.0)
    assert forecast.expected_tokens(("b", 1, "baseline")) == 300  # the same question's other answer
    assert forecast.expected_tokens(("c", 1, "mars")) == pytest.approx((100 + 120 + 300) / 3)
    assert forecast.seconds_per_token("baseline") == 0.5
    assert forecast.seconds_per_token("mars") == pytest.approx(42 / 420)
    mean = (100 + 120 + 300) / 3
    assert forecast.seconds_left() == pytest.approx(300 * 0.5 + 2 * mean * 0.5 + 2 * mean * 0.1)
    assert forecast.questions_done() == 1


def test_a_failed_row_is_done_but_no_length_and_a_method_without_rows_takes_the_pooled_speed():
    forecast = forecast_of(PLANNED, 512, [row("a", "baseline", 600, seconds=60.0)])  # a kept row: its own seconds
    assert forecast.expected_tokens(("a", 1, "mars")) == 512  # its question's answer, capped at the budget
    assert forecast.seconds_per_token("baseline") == pytest.approx(60 / 512)
    assert forecast.seconds_per_token("mars") == pytest.approx(60 / 512)  # nothing else measured yet
    forecast.finish(row("a", "mars", 0, status="failed"), wall_s=3.0)
    assert ("a", 1, "mars") not in forecast.coming() and forecast.answers.count == 1  # done, with no length
    assert forecast.seconds_per_token("mars") == pytest.approx(60 / 512)  # the failure's seconds count for nothing


def test_a_failed_turn_ends_its_question_for_that_method_only():
    planned = [(question, turn, method) for question in ("a", "b") for turn in (1, 2) for method in ("baseline", "mars")]
    forecast = Forecast(planned, budget=64)
    forecast.finish(row("a", "mars", 0, status="failed"), wall_s=1.0)
    assert ("a", 2, "mars") not in forecast.coming() and ("a", 2, "baseline") in forecast.coming()


def test_a_whole_tasks_cell_reads_the_measured_lengths_where_it_has_them_and_the_means_elsewhere():
    planned = [(str(question), 1, method) for question in range(1500) for method in ("baseline", "mars")]
    forecast = Forecast(planned, budget=512, measured={f"{q}:1": 100.0 for q in range(0, 1500, 2)})
    for question in range(50):
        forecast.finish(row(str(question), "baseline", 200), wall_s=20.0)
    # q0-49's other answers: 200 (their own question's); q50-1499: 100 where measured (the even ones), else 200
    assert forecast.seconds_left() == pytest.approx((50 * 200 + 1450 * 100 + 1450 * 200) * 0.1)


def test_durations_read_as_a_person_reads_them():
    assert [minutes(s) for s in (-3, 45, 250, 4500)] == ["0 s", "45 s", "4 min 10 s", "1 h 15 min"]
    assert error_pct(110, 100) == pytest.approx(10.0)


def test_the_bar_states_the_whole_duration_after_two_prompts_and_sets_it_beside_what_it_took(monkeypatch, capsys):
    clock = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(TokenProgress, "pointed", False)  # as in a new process
    with TokenProgress(PLANNED, 512, [], desc="cell", disable=False) as bar:
        clock[0] += 20  # a warm-up, which no row's speed counts
        bar.begin()
        for question in "abcd":
            for method, seconds_per_token in (("baseline", 0.5), ("mars", 0.1)):
                clock[0] += 200 * seconds_per_token
                bar.add(row(question, method, 200))
    err = capsys.readouterr().err
    assert f"a 1-minute look: {SHORT_LOOK}" in err  # 8 rows of up to 512 tokens
    # after a and b: 20 s warm-up + 2 * (100 + 20) s, and c and d expected to take as long
    assert "mars_bench: 2 of 4 prompts done, 4 min 20 s into this run; about 4 min 0 s left, 8 min 20 s in all" in err
    assert "mars_bench: the cell took 8 min 20 s in this run; predicted 8 min 20 s once 2 prompts were done (+0%)" in err
    with TokenProgress(PLANNED, 512, [], desc="the next cell", disable=False):
        pass
    assert SHORT_LOOK not in capsys.readouterr().err  # named once a process, not once a sweep's cell


def test_a_batch_shares_its_wall_time_between_its_rows_by_their_tokens(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    with TokenProgress(PLANNED, 512, [], desc="cell", disable=True) as bar:
        bar.begin()
        clock[0] += 30.0  # a batch of 2 rows of the baseline, then of the method, each decoded together
        bar.add_batch([row("a", "baseline", 100), row("b", "baseline", 200)])
        clock[0] += 6.0
        bar.add_batch([row("a", "mars", 100), row("b", "mars", 200)])
        assert bar.forecast.seconds_per_token("baseline") == pytest.approx(30 / 300)
        assert bar.forecast.seconds_per_token("mars") == pytest.approx(6 / 300)


def test_a_quiet_bar_prints_no_line(monkeypatch, capsys):
    with TokenProgress(PLANNED, 512, [], desc="cell", disable=True) as bar:
        bar.begin()
        for question in "abcd":
            for method in ("baseline", "mars"):
                bar.add(row(question, method, 200))
    assert "mars_bench" not in capsys.readouterr().err


def test_a_question_not_answered_yet_is_expected_as_long_as_its_answers_measured_before(tmp_path):
    forecast = Forecast(PLANNED, budget=512, measured={"c:1": 80.0, "d:1": 900.0})
    forecast.finish(row("a", "baseline", 300), wall_s=30.0)
    assert forecast.expected_tokens(("a", 1, "mars")) == 300  # this run's own answer to the question first
    assert forecast.expected_tokens(("c", 1, "mars")) == 80  # then the lengths measured before
    assert forecast.expected_tokens(("d", 1, "mars")) == 512  # never beyond the budget
    assert forecast.expected_tokens(("b", 1, "mars")) == 300  # else this run's mean


def test_the_measured_lengths_are_the_committed_runs_means_as_the_script_writes_them(tmp_path):
    from mars_bench.bench.duration import MEASURED_LENGTHS, measured_lengths
    from mars_bench.bench.records import RECORDS_FILE

    humaneval = measured_lengths("qwen2.5-coder-1.5b", "humaneval")  # the main job's task, as committed
    assert len(humaneval) >= 10 and all(key.endswith(":1") and value > 0 for key, value in humaneval.items())
    assert measured_lengths("no-such-model", "humaneval") == {}
    run = tmp_path / "run"
    run.mkdir()
    rows = [{**row(q, m, n), "model": "m", "task": "t"} for q, m, n in (("7", "baseline", 100), ("7", "mars", 50))]
    (run / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = load_script(Path(__file__).parents[1] / "benchmarks" / "answer_lengths.py")
    script.main([str(run), "--write-lengths", str(tmp_path / "lengths.json")])
    assert measured_lengths("m", "t", tmp_path / "lengths.json") == {"7:1": 75.0}
    committed = json.loads(MEASURED_LENGTHS.read_text())  # the package's file is what its sources give today
    repo = Path(__file__).parents[1]
    script.main([str(repo / source) for source in committed["sources"]] + ["--write-lengths", str(tmp_path / "again.json")])
    again = json.loads((tmp_path / "again.json").read_text())
    assert (again["lengths"], again["answers"]) == (committed["lengths"], committed["answers"])
