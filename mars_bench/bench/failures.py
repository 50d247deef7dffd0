"""Counting failed rows, per run and across a sweep (a Hydra callback)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from mars_bench.bench.records import RECORDS_FILE, read_rows

FAILED_EXIT = 3


def failed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if row.get("status") != "ok"]


def failure_line(rows: list[dict[str, Any]]) -> str | None:
    failed = failed_rows(rows)
    if not failed:
        return None
    first = failed[0]
    return f"{len(failed)} of {len(rows)} rows failed (first: question {first['question_id']}, {first['error']})"


class SweepReport(Callback):
    """After a multirun: say how many cells had failures, and exit non-zero if any did."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        cells = sorted(p.parent for p in sweep.glob(f"*/{RECORDS_FILE}"))
        failing = [cell for cell in cells if failed_rows(list(read_rows(cell / RECORDS_FILE)))]
        print(f"sweep {sweep}: {len(cells)} cells, {len(failing)} with failures", file=sys.stderr)
        for cell in failing:
            print(f"  {cell.name}: {failure_line(list(read_rows(cell / RECORDS_FILE)))}", file=sys.stderr)
        if failing:
            raise SystemExit(FAILED_EXIT)
