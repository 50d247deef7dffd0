"""Scorers that need no sandbox: GSM8K final-number match."""

from __future__ import annotations

import re

from mars_bench.tasks.questions import Question

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> float | None:
    text = text.replace("$", "").replace(",", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        return None


def extract_final_number(text: str) -> float | None:
    """The answer after the first ``#### `` marker, else the last number in the text."""
    marker = re.search(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    if marker:
        return _number(marker.group(1))
    numbers = NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None


def gsm8k_score(answer: str, question: Question) -> float | None:
    """1.0 if the answer's final number equals the reference's ``#### N``, else 0.0."""
    if not question.reference:
        return None
    gold = extract_final_number(question.reference[-1])
    predicted = extract_final_number(answer)
    return float(gold is not None and predicted is not None and abs(gold - predicted) < 1e-6)


SCORERS = {"gsm8k": gsm8k_score}
