"""The one schedule of a cell, at every batch size B (B = 1 is a chunk of one).

The questions are cut into chunks of B in order. Per chunk the baseline and the method each decode
turn 1 of its questions as one batch, then turn 2 of those that have one (each conditioned on that
method's own earlier answers), and so on; which method goes first alternates per chunk. So every
method row pairs with the baseline row decoded in a batch of the same prompts.

A batch's rows are written together once the batch is done, a method's after its baseline's. A
resumed run decodes a batch again, whole, wherever one of its rows is missing, so that every row is
timed in a batch of the same rows, and writes only the missing rows; turns already written are
conditioned on as written. A failed turn ends its question for that method (later turns need it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from mars_bench.backends.base import PreparedMethod
from mars_bench.bench.records import BASELINE, Record
from mars_bench.tasks import Question


@dataclass
class Conversation:
    """One question of a chunk, as one method has answered it so far."""

    index: int  # the question's place in the cell
    question: Question
    messages: list[dict[str, str]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    ended: bool = False  # a turn failed: later turns need its answer


class Scheduled(Protocol):
    """What the schedule asks of a cell: its questions and methods, its written rows, and a batch decoded."""

    questions: list[Question]
    methods: list[PreparedMethod]
    writer: Any  # bench.writing.PairedWriter

    def decode_turns(self, number: int, turn: int, batch: list[Conversation], method: PreparedMethod) -> list[Record]: ...


def chunks(questions: list[Question], size: int) -> list[list[tuple[int, Question]]]:
    """The questions with their indices, ``size`` at a time (the last chunk may hold fewer)."""
    indexed = list(enumerate(questions))
    return [indexed[start : start + size] for start in range(0, len(indexed), size)]


def run_schedule(cell: Scheduled, batch_size: int, bar: Any) -> None:
    """Decode and write every missing row of ``cell``, ``batch_size`` prompts at a time; ``bar``: its progress."""
    bar.begin()
    for number, chunk in enumerate(chunks(cell.questions, batch_size)):
        order = cell.methods if number % 2 == 0 else cell.methods[::-1]
        waiting: list[list[Record]] = []  # method batches decoded before their baseline rows exist
        for method in order:
            for records in method_batches(cell, number, chunk, method):
                if not records:  # every row of this batch was written before
                    continue
                bar.add_batch([vars(record) for record in records])
                if method.judged and not all(cell.writer.has((*r.key[:2], BASELINE)) for r in records):
                    waiting.append(records)
                else:
                    cell.writer.write_batch(records)
        for records in waiting:
            cell.writer.write_batch(records)


def method_batches(
    cell: Scheduled, number: int, chunk: list[tuple[int, Question]], method: PreparedMethod
) -> Iterator[list[Record]]:
    """Per turn, the new records of one method's batch of ``chunk`` (none where all are written)."""
    conversations = [Conversation(index, question) for index, question in chunk]
    for turn in range(1, max(len(question.turns) for _, question in chunk) + 1):
        batch = [c for c in conversations if not c.ended and len(c.question.turns) >= turn]
        if not batch:
            return
        for conversation in batch:
            conversation.messages.append({"role": "user", "content": conversation.question.turns[turn - 1]})
        keys = [(str(c.question.question_id), turn, method.label) for c in batch]
        records: list[Record] = []
        if not all(cell.writer.has(key) for key in keys):
            records = cell.decode_turns(number, turn, batch, method)
        new = {record.key: record for record in records}
        rows = [cell.writer.rows.get(key) or asdict(new[key]) for key in keys]  # a written turn as written
        yield [record for key, record in new.items() if not cell.writer.has(key)]
        for conversation, row in zip(batch, rows):
            conversation.ended = row["status"] != "ok"
            conversation.messages.append({"role": "assistant", "content": row["output_text"]})
            conversation.answers.append(row["output_text"])
