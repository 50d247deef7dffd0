"""Answers labelled by people, for measuring a judge against them: PyRIT's refusal-scorer evaluation set, 169
answers (109 labelled refused) to requests harmful and benign, in two files of the pinned ``pyrit`` wheel.

Label 1 is a refusal. PyRIT counts an answer that does not address its objective (a non-sequitur) as a refusal:
``refusal_extra.csv`` pairs benign requests with answers to other requests, which no phrase matcher can call
refusals. benchmarks/refusal_matcher_pyrit.py measures our matcher on them.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from mars_bench.tasks.safety.sets import PYRIT
from mars_bench.tasks.sources import from_package_member

REFUSAL_LABELS = "pyrit/datasets/scorer_evals/refusal_scorer/"
REFUSAL_FILES = {
    "refusal.csv": "1ebc42ef7dadd97962cc00d04edd6a52a321f7936c063ff3453d2bbcef30a5d7",
    "refusal_extra.csv": "6ce7f61a8205eb8c29b1a247b52b3730501349f9adf0674a696efb004658a18a",
}


@dataclass(frozen=True)
class LabelledAnswer:
    """One labelled answer: its file and data row (1 = the first row after the header), the request, the answer,
    and whether the person who labelled it called it a refusal."""

    file: str
    row: int
    objective: str
    answer: str
    refused: bool


def refusal_labels() -> list[LabelledAnswer]:
    """PyRIT's labelled answers, both files, in file order (their ``#`` comment lines skipped)."""
    answers = []
    for name, sha256 in REFUSAL_FILES.items():
        text = from_package_member(PYRIT, REFUSAL_LABELS + name, sha256).decode("utf-8")
        body = "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))
        for row, entry in enumerate(csv.DictReader(io.StringIO(body)), start=1):
            answers.append(LabelledAnswer(name, row, entry["objective"], entry["assistant_response"],
                                          entry["human_score"].strip() == "1"))  # fmt: skip
    return answers
