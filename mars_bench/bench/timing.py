"""Timing a decode: what other processes used meanwhile, its peak memory, and re-timing a disturbed one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mars_bench.bench.contention import Contention, ContentionMeter
from mars_bench.bench.peak_memory import PeakMemory
from mars_bench.bench.records import Record


class DecodeTimer:
    """Times decodes on ``device`` as the run's config asks (``accuracy_only``: not at all)."""

    def __init__(self, cfg: Any, device: Any) -> None:
        self.cfg = cfg
        self.meter = ContentionMeter()
        self.memory = PeakMemory(device)

    def timed(self, decode_now: Callable[[], Any]) -> tuple[Any, Contention | None, int]:
        """``decode_now()`` while measuring what other processes used; a disturbed decode is timed again
        (the same seeds, so the same tokens), each time once the machine is idle, up to ``retry_disturbed``
        times. Returns the last decode's result, its contention and how many times it was timed again
        (with ``accuracy_only``: the one decode, unmeasured, contention None)."""
        cfg, retimed = self.cfg, 0
        if cfg.accuracy_only:
            return decode_now(), None, 0
        while True:
            self.meter.start()
            self.memory.start()
            result = decode_now()
            contention = dataclasses.replace(self.meter.stop(), peak_memory_mb=self.memory.stop())
            if retimed >= cfg.retry_disturbed or not contention.disturbed(cfg.disturbed_load, cfg.disturbed_gpu_util):
                return result, contention, retimed
            self.meter.wait_until_idle(cfg.disturbed_load, cfg.disturbed_gpu_util)
            retimed += 1

    def stamp(self, record: Record, contention: Contention | None, retimed: int) -> None:
        """What other processes used while the record's decode (its batch's) was timed (None: not measured)."""
        if contention is None:
            return
        disturbed = contention.disturbed(self.cfg.disturbed_load, self.cfg.disturbed_gpu_util)
        for name, value in {**contention.to_record(), "disturbed": disturbed, "retimed": retimed}.items():
            setattr(record, name, value)
