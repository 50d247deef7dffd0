"""Baseline rows shared by the cells of a sweep.

A threshold sweep runs the same baseline (same target, prompt, sampling settings and seed)
once per theta; with a shared cache folder each baseline is decoded once and every other
cell copies its row. The copy says where it came from (``baseline_from``). Its seconds were
measured in the first cell, so speedups of later cells compare against a baseline timed
earlier on the same machine rather than alternated with them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from mars_bench.bench.records import drop_partial_tail, read_rows

CACHE_FILE = "baselines.jsonl"


def baseline_key(cfg: Any, question_id: Any, prompt: list[int], seed: int) -> str:
    """Everything that fixes a baseline's output, its score and its timing conditions, hashed."""
    model = cfg.model
    fixed = {
        "target": model.target,
        "dtype": model.dtype,
        "attn": model.attn_implementation,
        "device_map": model.device_map,
        "task": cfg.task.name,
        "scorer": cfg.task.scorer,
        "question_id": str(question_id),
        "prompt": prompt,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": seed,
        "threads": cfg.threads,
    }
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


class BaselineCache:
    """An append-only JSON Lines file of (key, row), safe for cells running in parallel."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / CACHE_FILE
        self.rows: dict[str, dict[str, Any]] = {}

    def get(self, key: str) -> dict[str, Any] | None:
        if key not in self.rows:  # another cell may have added it since we last looked
            self.rows = {entry["key"]: entry["row"] for entry in read_rows(self.path)}
        return self.rows.get(key)

    def put(self, key: str, row: dict[str, Any]) -> None:
        line = json.dumps({"key": key, "row": row}, ensure_ascii=False, allow_nan=False) + "\n"
        with self.path.open("a", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # whole lines only, even from parallel cells
            drop_partial_tail(self.path)
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
            fcntl.flock(handle, fcntl.LOCK_UN)
        self.rows[key] = row
