"""Baseline rows shared by the cells of a sweep.

A sweep over a verifier's setting runs the same baseline (same target, prompt, sampling settings
and seed) once per value; with a shared cache folder each baseline is decoded once and every other
cell copies its row. The copy says where it came from (``baseline_from``). Its seconds were
measured in the first cell, so speedups of later cells compare against a baseline timed
earlier on the same machine rather than alternated with them.

Cells may run at once, as jobs on several nodes over a shared filesystem. Each baseline is a
file of its own (``<key>.json``), created whole by an atomic link, so it is kept exactly once
even if two jobs race. Before decoding one a job claims it (``<key>.claim``, bench/claims.py);
a job that finds the claim taken waits for the row instead of decoding it again. Folders from
before these files (one ``baselines.jsonl``) are still read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from mars_bench.bench.claims import Claim
from mars_bench.bench.records import EARLIER_BACKEND, RECORD_FIELDS, read_rows
from mars_bench.common.files import atomic_create
from mars_bench.common.kernels import EARLIER_KERNELS
from mars_bench.tasks.safety.scoring import record_judge

CACHE_FILE = "baselines.jsonl"  # the single file older versions appended to (read, never written)
ENTRY_SUFFIX = ".json"


def baseline_conditions(cfg: Any) -> dict[str, Any]:
    """The run's ``records.BASELINE_CONDITIONS``, in that order, read from its config: what every record
    carries of them (a config older than ``batch_size`` decoded one prompt at a time: 1)."""
    model, task = cfg.model, cfg.task
    return {"target": model.target, "dtype": model.dtype, "attn_implementation": model.attn_implementation,
            "device_map": model.device_map, "task": task.name, "scorer": task.scorer, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "threads": cfg.threads, "batch_size": getattr(cfg, "batch_size", 1),
            "backend": getattr(cfg, "backend", EARLIER_BACKEND),
            "kernels": getattr(model, "kernels", EARLIER_KERNELS), "judge": record_judge(task)}  # fmt: skip


HASHED_AS = {"attn_implementation": "attn"}  # the names earlier versions hashed: their cached baselines still match


def baseline_key(cfg: Any, question_id: Any, prompt: list[int], seed: int) -> str:
    """The run's baseline conditions, the question, the prompt's token ids and its own ``seed`` (derived
    from the run's, which it replaces), hashed."""
    fixed = {HASHED_AS.get(name, name): value for name, value in baseline_conditions(cfg).items()}
    if fixed["batch_size"] == 1:
        del fixed["batch_size"]  # as earlier versions hashed it: their cached baselines still match
    if fixed["backend"] == EARLIER_BACKEND:
        del fixed["backend"]  # likewise
    if fixed["kernels"] == EARLIER_KERNELS:
        del fixed["kernels"]  # likewise
    if fixed["judge"] is None:
        del fixed["judge"]  # likewise
    fixed |= {"question_id": str(question_id), "prompt": prompt, "seed": seed}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def batch_baseline_key(cfg: Any, rows: list[tuple[Any, list[int], int]]) -> str:
    """The key of a baseline batch: its rows' ``baseline_key`` (each row's question, prompt and seed), in order."""
    keys = [baseline_key(cfg, question_id, prompt, seed) for question_id, prompt, seed in rows]
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()


def retired_settings() -> frozenset[str]:
    """The fields that rows cached by schema 6 and older carry and records no longer have: the verifier settings
    those writers put beside ``verifier_setting`` (any registered verifier's setting that no Record declares).
    The registry is read here, when a cell reads its cache, so that importing this module never imports torch."""
    from mars_bench.verification import available_verifiers, verifier_settings

    names = {item.name for name in available_verifiers() for item in fields(verifier_settings(name))}
    return frozenset(names - RECORD_FIELDS)


def cache_entries(folder: Path) -> list[Path]:
    """The entry files of a cache folder (one baseline each)."""
    return sorted(path for path in folder.glob(f"*{ENTRY_SUFFIX}") if not path.name.startswith("."))


class BaselineCache:
    """One file per baseline (key, row), safe for cells running at once on one machine or many."""

    def __init__(self, folder: str | Path, poll_s: float = 2.0) -> None:
        self.folder, self.poll_s = Path(folder), poll_s  # poll_s: how often a waiting job looks for the row
        self.folder.mkdir(parents=True, exist_ok=True)
        self.legacy = {entry["key"]: entry["row"] for entry in read_rows(self.folder / CACHE_FILE)}
        self.claims: dict[str, Claim] = {}

    def entry(self, key: str) -> Path:
        return self.folder / f"{key}{ENTRY_SUFFIX}"

    def get(self, key: str) -> dict[str, Any] | None:
        """The kept row of ``key`` (None: none yet), less the fields that rows cached by older versions
        carry and records no longer have (``retired_settings``)."""
        try:
            row = json.loads(self.entry(key).read_text(encoding="utf-8"))["row"]
        except FileNotFoundError:
            row = self.legacy.get(key)
        if row is None:
            return None
        retired = retired_settings()
        return {name: value for name, value in row.items() if name not in retired}

    def get_or_claim(self, key: str) -> dict[str, Any] | None:
        """The kept row of ``key``, waiting for it while another job decodes it; None once this job
        has claimed its decoding (then ``put`` the row, or ``release`` the claim if decoding failed)."""
        while (row := self.get(key)) is None:
            if self.claim(key):
                if (row := self.get(key)) is not None:  # kept between our look and our claim
                    self.release(key)
                return row
            if (row := self.wait(key)) is not None:
                return row
        return row

    def claim(self, key: str) -> bool:
        """Claim the decoding of ``key``'s baseline; False while another live job holds the claim."""
        claim = self.claims.setdefault(key, Claim(self.folder / f"{key}.claim"))
        return claim.take()

    def wait(self, key: str) -> dict[str, Any] | None:
        """The row another job is decoding, once it is kept; None when that job gave up (or died) without it."""
        claim = self.claims.setdefault(key, Claim(self.folder / f"{key}.claim"))
        claim.wait(self.poll_s, done=self.entry(key).exists)
        return self.get(key)

    def put(self, key: str, row: dict[str, Any]) -> dict[str, Any]:
        """Keep ``row`` unless another job kept one first; the row kept. Releases this job's claim."""
        data = json.dumps({"key": key, "row": row}, ensure_ascii=False, allow_nan=False).encode("utf-8")
        kept = row if atomic_create(self.entry(key), data) else self.get(key) or row
        self.release(key)
        return kept

    def release(self, key: str) -> None:
        if key in self.claims:
            self.claims.pop(key).release()
