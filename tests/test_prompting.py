"""Prompt formats: HumanEval in EvalPlus's chat format (instruction, a reply begun in the prompt, stop
strings) and the scorer of its self-contained scripts."""

from __future__ import annotations

import pytest
from conftest import run_config

from mars_bench.config.checks import check_run_config
from mars_bench.models.loading import chat_prompt_ids
from mars_bench.tasks.prompting import cut_at_stop_string, task_stop_strings, user_text
from mars_bench.tasks.providers import HUMANEVAL_PREFIX, humaneval_from_package
from mars_bench.tasks.questions import Question
from mars_bench.tasks.scoring import humaneval_problems, humaneval_script_score, script_code

EVALPLUS_INSTRUCTION = "Please provide a self-contained Python script that solves the following problem in a markdown code block:"
EVALPLUS_REPLY = "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:"


@pytest.fixture(scope="module")
def evalplus():
    return run_config("task=humaneval_evalplus").task


def test_the_evalplus_task_wraps_the_raw_problem_and_begins_the_reply_with_an_open_fence(evalplus):
    question = humaneval_from_package(1).questions[0]
    assert question.turns[0].startswith(HUMANEVAL_PREFIX)  # the MARS format, as every source serves it
    raw = humaneval_problems()[0]["prompt"]
    assert user_text(evalplus, question.turns[0]) == f"{EVALPLUS_INSTRUCTION}\n```\n{raw.strip()}\n```\n"
    assert evalplus.answer_prefix == f"{EVALPLUS_REPLY}\n```python\n"
    assert task_stop_strings(evalplus) == ("\n```\n", "\nif __name__", "\ndef main(", "\nprint(")
    check_run_config(run_config("task=humaneval_evalplus"))
    mars = run_config("task=humaneval").task
    assert user_text(mars, question.turns[0]) == question.turns[0] and task_stop_strings(mars) == ()


def test_a_reply_prefix_sits_where_the_chat_template_puts_the_reply(tiny_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    plain = chat_prompt_ids(tokenizer, ["Write add."])
    prefixed = chat_prompt_ids(tokenizer, ["Write add."], answer_prefix="Here:\n```python\n")
    assert prefixed[: len(plain)] == plain  # the generation prompt, then the prefix, trailing newline kept
    assert tokenizer.decode(prefixed[len(plain) :]) == "Here:\n```python\n"


def test_an_answer_is_cut_where_its_first_stop_string_begins():
    stops = ("\n```\n", "\nprint(")
    assert cut_at_stop_string("def f():\n    return 1\n```\nMore text", stops) == "def f():\n    return 1"
    assert cut_at_stop_string("x = 1\nprint(x)\n```\n", stops) == "x = 1"
    assert cut_at_stop_string("no stop here", stops) == "no stop here"


def test_a_script_keeps_its_definitions_and_drops_example_calls():
    answer = "import math\n\ndef area(r):\n    return math.pi * r * r\n\nLIMIT = 3\nprint(area(2))\narea(1)\n```\nText"
    assert script_code(answer) == "import math\ndef area(r):\n    return math.pi * r * r\nLIMIT = 3\n"


def test_a_script_scores_by_running_alone_with_the_tests_in_the_sandbox():
    problem = humaneval_problems()[0]
    solution = problem["prompt"] + problem["canonical_solution"]  # the signature restated, as instruct models write it
    assert humaneval_script_score(solution + "\n\nprint(has_close_elements([1.0], 0.5))\n", Question(0, ["q"])) == 1.0
    body_only = problem["canonical_solution"]  # no def: the script alone defines nothing to test
    assert humaneval_script_score(body_only, Question(0, ["q"])) == 0.0
    untyped = solution.replace("from typing import List\n", "")  # List undefined: EvalPlus runs the script as written
    assert humaneval_script_score(untyped, Question(0, ["q"])) == 0.0
