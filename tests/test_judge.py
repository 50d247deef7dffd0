"""MT-bench LLM-judge scoring: FastChat's single-answer prompts, the right variant per turn
and reference, the [[rating]] parsed, and a whole two-turn run scored end to end."""

from __future__ import annotations

import pytest
from conftest import SHARED_DATA, TINY, app

from mars_bench.bench.records import read_rows
from mars_bench.tasks.judge import judge_messages, load_judge_prompts, parse_rating
from mars_bench.tasks.questions import Question


@pytest.fixture(scope="module")
def prompts():
    return load_judge_prompts(str(SHARED_DATA))


def test_ratings_are_parsed_from_the_judge_text():
    assert parse_rating("Short explanation. Rating: [[7]]") == 7.0
    assert parse_rating("first [[3]] then [[8.5]]") == 8.5
    assert parse_rating("Rating: [6]") == 6.0
    assert parse_rating("I cannot rate this.") is None


def test_each_turn_gets_its_fastchat_prompt(prompts):
    plain = Question(81, ["Write a poem.", "Now shorter."], "writing")
    system, user = judge_messages(prompts, plain, ["A poem."], 1)
    assert "[Question]\nWrite a poem." in user and "A poem." in user and "impartial judge" in user and system
    _, user2 = judge_messages(prompts, plain, ["A poem.", "Short."], 2)
    assert "Now shorter." in user2 and "Short." in user2 and "A poem." in user2
    math = Question(111, ["What is 2+2?", "And 3+3?"], "math", ["4", "6"])
    _, math_user = judge_messages(prompts, math, ["4", "6"], 2)
    assert "Reference Solution" in math_user or "reference" in math_user.lower()


def test_the_judge_prompts_come_from_the_pinned_package_too(tmp_path):
    assert set(load_judge_prompts(str(tmp_path))) >= {"single-v1", "single-v1-multi-turn", "single-math-v1"}


@pytest.mark.slow
def test_a_two_turn_mt_bench_run_is_judged(tmp_path, tiny_target):
    """The tiny target (conftest.tiny_target) answers and judges: the judge's path, prompt to rating, is any model's."""
    out = tmp_path / "run"
    result = app(
        "experiment=smoke", "task=mt_bench", "task.num_prompts=1", "max_new_tokens=6", "warmup=0", "progress=false", *TINY,
        "task.scorer=judge", f"task.judge_model={tiny_target}", "task.judge_max_new_tokens=12", f"output_dir={out}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = list(read_rows(out / "records.jsonl"))
    assert sorted((r["turn"], r["method"]) for r in rows) == [(1, "baseline"), (1, "mars"), (2, "baseline"), (2, "mars")]
    assert all(r["status"] == "ok" for r in rows)
    assert all(r["score"] is None or 1 <= r["score"] <= 10 for r in rows)  # a small judge may give no rating


def test_judge_needs_a_judge_model():
    result = app("experiment=smoke", "task=mt_bench", "task.scorer=judge")
    assert result.returncode == 2 and "task.scorer=judge needs task.judge_model" in result.stderr
