"""Gather every records file below run or sweep folders into one tidy table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mars_bench.bench.records import RECORDS_FILE, read_rows


class NoRecordsError(ValueError):
    """Nothing to analyse: the message says where we looked."""


def gather(folders: list[str | Path]) -> pd.DataFrame:
    """One row per record; ``run_dir`` says which folder it came from (several sweeps, machines)."""
    frames = []
    for folder in map(Path, folders):
        if not folder.exists():
            raise NoRecordsError(f"folder {str(folder)!r} does not exist")
        for records in sorted(folder.rglob(RECORDS_FILE)):
            rows = list(read_rows(records))
            if rows:
                frames.append(pd.DataFrame(rows).assign(run_dir=str(records.parent)))
    if not frames:
        raise NoRecordsError(f"no {RECORDS_FILE} with finished rows below {', '.join(map(str, folders))}")
    return pd.concat(frames, ignore_index=True)


def finished(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows that decoded successfully, with their total seconds."""
    ok = frame[frame["status"] == "ok"].copy()
    ok["seconds"] = ok["prefill_s"] + ok["decode_s"]
    ok["emitted"] = ok["new_tokens"] - 1
    return ok
