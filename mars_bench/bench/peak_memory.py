"""The peak memory of one timed decode: what a batch of B rows costs beside the weights.

On a CPU it is the process's resident high-water mark (``VmHWM``), reset before the decode by
writing 5 to ``/proc/self/clear_refs`` (Linux 4.0 on; elsewhere it is not measured: None). On a GPU
target it is the device's peak allocated memory, reset with ``torch.cuda.reset_peak_memory_stats``.
Either includes the weights, which every batch size shares.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
MIB = 1 << 20


def resident_peak_mb() -> float | None:
    """This process's resident high-water mark since its last reset, MiB; None where unreadable."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


class PeakMemory:
    """``start()`` before a decode, ``stop()`` after it: the peak memory in between, MiB (None: not measurable)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = True

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            CLEAR_REFS.write_text("5")
        except OSError:  # not Linux, or not allowed: the high-water mark cannot be reset
            self.resettable = False

    def stop(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / MIB
        return resident_peak_mb() if self.resettable else None
