"""Counting failed rows, per run and across a sweep (a Hydra callback)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from mars_bench.bench.records import RECORDS_FILE, read_rows

FAILED_EXIT = 3
WHOLE_CELL = "*"  # the question of a row saying the whole cell failed (``rows.failure_record`` without a question)


def is_cell_failure(row: dict[str, Any]) -> bool:
    """Whether ``row`` says a whole cell failed (a model that would not load, an engine that died mid-run)."""
    return str(row.get("question_id")) == WHOLE_CELL and row.get("status") != "ok"


def standing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A records file's ``rows``, in its order, less the whole-cell failures a later run went past: one stands only
    as the file's last row (a rerun that resumed the cell wrote its rows after it)."""
    return [row for index, row in enumerate(rows) if not is_cell_failure(row) or index == len(rows) - 1]


def failure_line(rows: list[dict[str, Any]]) -> str | None:
    """How many rows failed and the first error, or None when none did."""
    failed = [row for row in rows if row.get("status") != "ok"]
    if not failed:
        return None
    first = failed[0]
    return f"{len(failed)} of {len(rows)} rows failed (first: question {first['question_id']}, {first['error']})"


class SweepReport(Callback):
    """After a multirun: say how many cells had failures, and exit non-zero if any did."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        rows = {path.parent.name: standing(list(read_rows(path))) for path in sorted(sweep.glob(f"*/{RECORDS_FILE}"))}
        failing = {cell: line for cell, cell_rows in rows.items() if (line := failure_line(cell_rows))}
        print(f"sweep {sweep}: {len(rows)} cells, {len(failing)} with failures", file=sys.stderr)
        for cell, line in failing.items():
            print(f"  {cell}: {line}", file=sys.stderr)
        if failing:
            raise SystemExit(FAILED_EXIT)
