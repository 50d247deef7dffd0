"""Prompt sets and scorers."""

from mars_bench.tasks.questions import Question, QuestionFileError, read_questions
from mars_bench.tasks.scoring import SCORERS

__all__ = ["SCORERS", "Question", "QuestionFileError", "read_questions"]
