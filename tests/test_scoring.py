"""GSM8K scoring: the final-number extraction recovers every gold answer of the test split,
and a model answer scores by its ``#### N`` line, else its last number."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import SHARED_DATA

from mars_bench.tasks.providers import load_questions
from mars_bench.tasks.questions import Question
from mars_bench.tasks.scoring import (
    aime_score,
    cnndm_score,
    extract_code,
    extract_final_number,
    gsm8k_score,
    humaneval_problems,
    humaneval_score,
    pass_at_k,
    wmt19_score,
)

FULL_SPLIT = SimpleNamespace(  # the whole test split: the MARS file where ../shared/data is, else the pinned package
    name="gsm8k", file="gsm8k/question_full.jsonl", sources=["file", "package"], num_prompts=None, max_turns=None
)


def test_every_gsm8k_test_reference_extracts_to_its_gold_number():
    questions = load_questions(FULL_SPLIT, str(SHARED_DATA))
    assert len(questions) == 1319
    for question in questions:
        gold_line = question.reference[-1]
        assert gold_line.startswith("#### ")
        assert extract_final_number(gold_line) == float(gold_line[5:].replace(",", "")), question.question_id


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("She sells 9 eggs for $2 each.\n#### 18", 1.0),
        ("The answer is $18.00.", 1.0),
        ("#### 1,018", 0.0),
        ("first 18, then #### 20", 0.0),  # the marked answer wins over earlier numbers
        ("no number here", 0.0),
        ("#### -18", 0.0),
    ],
)
def test_gsm8k_answers_score_by_their_final_number(answer, score):
    question = Question(0, ["q"], "math", ["Janet sells 9 eggs.", "#### 18"])
    assert gsm8k_score(answer, question) == score


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("so the sum is \\boxed{70}.", "70", 1.0),
        ("\\boxed{\\frac{1}{2}} then \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{336^\\circ}", "336^\\circ", 1.0),
        ("\\boxed{71}", "70", 0.0),
        ("no box: 70", "70", 0.0),
        ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0),
    ],
)
def test_aime_scores_the_last_boxed_answer(answer, gold, score):
    assert aime_score(answer, Question(0, ["q"], "math", [gold])) == score


def test_code_is_taken_from_the_last_fenced_block_that_defines_a_function():
    answer = "Here:\n```python\nimport math\n```\nand\n```python\ndef f(x):\n    return x\n```\n```\nprint(f(1))\n```"
    assert extract_code(answer) == "def f(x):\n    return x\n"
    assert extract_code("def g():\n    pass") == "def g():\n    pass"


def test_a_block_cut_off_by_the_budget_keeps_its_complete_lines():
    cut = "```python\ndef f(x):\n    return x\n\nprint(f(\"never closed"
    assert extract_code(cut) == "def f(x):\n    return x\n\n"
    problem = humaneval_problems()[0]
    truncated = "```python\n" + problem["prompt"] + problem["canonical_solution"] + "\n# Check\nassert has_close_elements([1.0], "
    assert humaneval_score(truncated, Question(0, ["q"])) == 1.0


def test_humaneval_scores_by_running_the_tests_in_the_sandbox():
    problem = humaneval_problems()[0]
    good = "```python\n" + problem["prompt"] + problem["canonical_solution"] + "```"
    assert humaneval_score(good, Question(0, ["q"])) == 1.0
    assert (
        humaneval_score("```python\ndef has_close_elements(numbers, threshold):\n    return True\n```", Question(0, ["q"])) == 0.0
    )


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 1, 2) == pytest.approx(0.4)  # 4 of the 10 pairs of 5 samples hold the correct one
    with pytest.raises(ValueError, match="k=3 is invalid for 2 samples"):
        pass_at_k(2, 1, 3)


@pytest.mark.slow
def test_text_metrics_reward_overlap():
    reference = Question(0, ["q"], "", ["The cat sat on the mat."])
    assert cnndm_score("The cat sat on the mat.", reference) == pytest.approx(1.0)
    assert 0 < cnndm_score("A cat sat somewhere.", reference) < 1
    assert wmt19_score("The cat sat on the mat.", reference) == pytest.approx(100.0)
    assert wmt19_score("Dogs bark.", reference) < 10
