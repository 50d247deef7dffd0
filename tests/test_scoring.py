"""GSM8K scoring: the final-number extraction recovers every gold answer of the test split,
and a model answer scores by its ``#### N`` line, else its last number."""

from __future__ import annotations

import pytest
from conftest import SHARED_DATA

from mars_bench.tasks import read_questions
from mars_bench.tasks.questions import Question
from mars_bench.tasks.scoring import extract_final_number, gsm8k_score

FULL_SPLIT = SHARED_DATA / "gsm8k" / "question_full.jsonl"


@pytest.mark.skipif(not FULL_SPLIT.is_file(), reason="needs ../shared/data")
def test_every_gsm8k_test_reference_extracts_to_its_gold_number():
    questions = read_questions(FULL_SPLIT)
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
