"""Writing a cell's records: each method row compared with its baseline row as it is written (its agreement, first
divergence and ROUGE-L, and for a safety task whether the baseline's refusal was kept)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mars_bench.bench.records import BASELINE, Record, RecordWriter
from mars_bench.bench.rows import compare
from mars_bench.tasks.safety.scoring import paired_safety
from mars_bench.tasks.scoring import rouge_l


class PairedWriter(RecordWriter):
    """A ``RecordWriter`` whose method rows carry their agreement with the baseline row of the same
    question and turn (when both are ``ok``); ``on_write`` is called after every write (a claim's heartbeat)."""

    def __init__(self, folder: Path, on_write: Callable[[], None] | None = None) -> None:
        super().__init__(folder)
        self.on_write = on_write

    def write_batch(self, records: list[Record]) -> None:
        """Append records together, first comparing each method row's output with its baseline row."""
        for record in records:
            baseline = self.rows.get((str(record.question_id), record.turn, BASELINE))
            if record.method != BASELINE and record.status == "ok" and baseline and baseline["status"] == "ok":
                record.agreement, record.first_divergence = compare(record.output_ids, baseline["output_ids"])
                record.baseline_rouge_l = rouge_l(record.output_text, baseline["output_text"])
                if record.safety and baseline.get("safety"):  # a safety scorer's: what the baseline's refusal became
                    record.safety = {**record.safety, **paired_safety(record.output_text, baseline["output_text"])}
        self.write_many(records)
        if self.on_write is not None:
            self.on_write()
