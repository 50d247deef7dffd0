"""How a task's question turns become the user's messages, and where its answers end.

A task config may wrap each user turn in an ``instruction`` (``{question}`` stands for the turn's text,
less the ``drop_prefix`` that the question file's turns begin with, stripped as EvalPlus strips it),
begin the assistant's reply with an ``answer_prefix`` placed in the prompt, and end answers at
``stop_strings`` besides the model's stop tokens. With none of them set a turn is used as written:
the MARS prompt formats are the question files' own text.
"""

from __future__ import annotations

from typing import Any

QUESTION = "{question}"


def user_text(task: Any, text: str) -> str:
    """The user message of one question turn under ``task``'s instruction (the turn as written without one)."""
    instruction = getattr(task, "instruction", None)
    if not instruction:
        return text
    return instruction.replace(QUESTION, text.removeprefix(getattr(task, "drop_prefix", "") or "").strip())


def task_stop_strings(task: Any) -> tuple[str, ...]:
    """The strings that end an answer of ``task`` (empty ones left out)."""
    return tuple(text for text in (getattr(task, "stop_strings", None) or ()) if text)


def cut_at_stop_string(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to its first stop string (the whole text where none occurs). Decoding ends at most one
    step past the step that completed a stop string, so the answer is cut where the string begins."""
    cut = min((index for stop in stops if (index := text.find(stop)) >= 0), default=len(text))
    return text[:cut]


def check_prompting(task: Any) -> None:
    """Refuse, in one line, an instruction that does not place the question."""
    instruction = getattr(task, "instruction", None)
    if instruction and QUESTION not in instruction:
        raise ValueError(f"task.instruction={instruction!r} is invalid: allowed is a text holding {QUESTION} (or null)")
