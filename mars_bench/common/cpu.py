"""The CPU a run is on, as /proc/cpuinfo names it: its model, its flags, and the kind the drafter tunings'
tables are keyed by (``conf/drafter_tuning``: ``cpu_tuning``).

The kinds differ in how bf16 matrix products run: ``amx`` (AMX tiles, ``amx_bf16``), ``avx512_bf16`` (native
bf16 dot products, no AMX) and ``avx2`` (neither: bf16 is emulated through float32). ``other`` is any other
machine: a CPU of none of these flags (ARM, an older x86) or one whose flags cannot be read.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # the x86 CPU flags of native bf16 matrix products
# kind -> the flag that names it, in the order they are told apart: the first flag a CPU has names its kind
CPU_KINDS = {"amx": "amx_bf16", "avx512_bf16": "avx512_bf16", "avx2": "avx2"}
OTHER_KIND = "other"


@functools.cache
def cpu_info() -> tuple[str | None, frozenset[str] | None]:
    """The CPU's model name and flags (None each where /proc/cpuinfo cannot be read)."""
    model, flags = None, None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        model = platform.processor() or None
    return model, flags


def cpu_kind(flags: frozenset[str] | set[str] | None = None) -> str:
    """The kind of a CPU with ``flags`` (this machine's by default): ``amx``, ``avx512_bf16``, ``avx2`` or ``other``."""
    flags = cpu_info()[1] if flags is None else flags
    if flags is None:
        return OTHER_KIND
    return next((kind for kind, flag in CPU_KINDS.items() if flag in flags), OTHER_KIND)


def placement_kind(device_map: str | None) -> str:
    """The tuning row a model placed by ``device_map`` takes: this CPU's kind on the CPU, ``other`` elsewhere (a GPU)."""
    return cpu_kind() if device_map in (None, "cpu") else OTHER_KIND
