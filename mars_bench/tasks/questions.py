"""FastChat-style question files: one JSON object per line with question_id, category,
turns (the user messages) and an optional reference."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Question:
    question_id: int | str
    turns: list[str]
    category: str = ""
    reference: list[str] = field(default_factory=list)
    request: str | None = None  # a wrapped prompt's bare request, which judges grade the answer against (jailbreaks)


class QuestionFileError(ValueError):
    """A question file is missing or malformed; the message names the file and line."""


def read_questions(path: str | Path, limit: int | None = None) -> list[Question]:
    """Parse a question file; ``limit`` keeps the first N questions."""
    path = Path(path)
    if not path.is_file():
        raise QuestionFileError(f"question file {str(path)!r} not found")
    questions: list[Question] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            questions.append(parse_question(line, path, number))
            if limit is not None and len(questions) >= limit:
                break
    if not questions:
        raise QuestionFileError(f"{path}: no questions in the file")
    return questions


def parse_question(line: str, path: Path, number: int) -> Question:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise QuestionFileError(f"{where}: bad JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise QuestionFileError(f"{where}: expected a JSON object with question_id and turns")
    for key in ("question_id", "turns"):
        if key not in record:
            raise QuestionFileError(f"{where}: missing field {key!r} (required: question_id, turns)")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise QuestionFileError(f"{where}: field 'turns' must be a non-empty list of strings")
    reference = record.get("reference") or []
    return Question(record["question_id"], turns, str(record.get("category", "")), [str(r) for r in reference])
