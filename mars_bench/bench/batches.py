"""A cell at ``batch_size`` B > 1: its questions B at a time, each batch decoded by the batched engine.

The questions are cut into chunks of B in order. Per chunk the baseline and the method each decode
turn 1 of its questions as one batch, then turn 2 of those that have one (each conditioned on that
method's own earlier answers), and so on; which method goes first alternates per chunk, as it
alternates per question at B = 1. So every method row at batch B pairs with the baseline row that
was decoded in a batch of the same prompts.

A batch's rows are written together once the batch is done (``RecordWriter.write_many``), a method's
after its baseline's. A resumed run decodes a batch again, whole, wherever one of its rows is
missing, so that every row is timed in a batch of the same rows, and writes only the missing rows;
turns already written are conditioned on as written. With a shared baseline cache a baseline batch
is decoded once per sweep and copied whole (``batch_baseline_key``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from mars_bench.bench.baseline_cache import batch_baseline_key
from mars_bench.bench.records import BASELINE, Record
from mars_bench.tasks import Question

if TYPE_CHECKING:
    from mars_bench.bench.cell import Cell, Method
    from mars_bench.bench.progress import TokenProgress


@dataclass
class Conversation:
    """One question of a chunk, as one method has answered it so far."""

    index: int  # the question's place in the cell
    question: Question
    messages: list[dict[str, str]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    ended: bool = False  # a turn failed: later turns need its answer


def chunks(questions: list[Question], size: int) -> list[list[tuple[int, Question]]]:
    """The questions with their indices, ``size`` at a time (the last chunk may hold fewer)."""
    indexed = list(enumerate(questions))
    return [indexed[start : start + size] for start in range(0, len(indexed), size)]


def run_batches(cell: Cell, bar: TokenProgress) -> None:
    """Decode and write every missing row of ``cell``, B prompts at a time."""
    for number, chunk in enumerate(chunks(cell.questions, cell.cfg.batch_size)):
        order = cell.methods if number % 2 == 0 else cell.methods[::-1]
        waiting: list[list[Record]] = []  # method batches decoded before their baseline rows exist
        for method in order:
            for records in method_batches(cell, number, chunk, method):
                if not records:  # every row of this batch was written before
                    continue
                for record in records:
                    bar.add(vars(record))
                if method.verifier is not None and not all(cell.writer.has((*r.key[:2], BASELINE)) for r in records):
                    waiting.append(records)
                else:
                    cell.write_batch(records)
        for records in waiting:
            cell.write_batch(records)


def method_batches(cell: Cell, number: int, chunk: list[tuple[int, Question]], method: Method) -> Iterator[list[Record]]:
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
            records = decode_batch_turn(cell, number, turn, batch, method)
        new = {record.key: record for record in records}
        rows = [cell.writer.rows.get(key) or asdict(new[key]) for key in keys]  # a written turn as written
        yield [record for key, record in new.items() if not cell.writer.has(key)]
        for conversation, row in zip(batch, rows):
            conversation.ended = row["status"] != "ok"
            conversation.messages.append({"role": "assistant", "content": row["output_text"]})
            conversation.answers.append(row["output_text"])


def decode_batch_turn(cell: Cell, number: int, turn: int, batch: list[Conversation], method: Method) -> list[Record]:
    """The records of one batch: every conversation's turn ``turn`` decoded together (or, for a baseline
    another cell of the sweep decoded, copied); a failure row for each where the batch failed."""
    from mars_bench.bench.cell import batch_fields, failure_record

    def failed(error: Exception) -> list[Record]:
        return [failure_record(cell.cfg, cell.name, error, c.question, turn, method.label) for c in batch]

    try:
        prompts = [cell.prompt_ids(c.messages) for c in batch]
        seeds = [cell.seed(c.index, turn) for c in batch]
    except Exception as error:  # a chat template that cannot take these messages
        return failed(error)
    shared = method.verifier is None and cell.baselines is not None
    rows = [(c.question.question_id, prompt, seed) for c, prompt, seed in zip(batch, prompts, seeds)]
    key = batch_baseline_key(cell.cfg, rows) if shared else ""
    if shared and (kept := cell.baselines.get_or_claim(key)) is not None:
        return [cell.copied_baseline(row) for row in kept["rows"]]
    try:
        results, contention, retimed = cell.timed(lambda: cell.decode_rows(method, prompts, seeds))
    except Exception as error:  # out of memory: every row of the batch says so, and the cell goes on
        if shared:
            cell.baselines.release(key)
        return failed(error)
    records = []
    for conversation, prompt, result, place in zip(batch, prompts, results, batch_fields(number, turn, results)):
        record = cell.record(conversation.question, turn, method, prompt, result, place)
        cell.add_contention(record, contention, retimed)
        try:
            cell.score(record, conversation.question, turn, conversation.answers)
        except Exception as error:  # a scorer bug fails this row only
            record = failure_record(cell.cfg, cell.name, error, conversation.question, turn, method.label)
        records.append(record)
    if shared and all(record.status == "ok" for record in records):
        cell.baselines.put(key, {"rows": [asdict(record) for record in records]})
    elif shared:
        cell.baselines.release(key)  # a batch with a failed row is for another job to decode again
    return records
