"""``backend=vllm``'s host memory: the plan made before any engine loads, and, after a worker died, whether the
kernel's OOM killer killed it.

The plan (``plan_memory``, pure over ``MemoryFigures``). Each prepared method is a vLLM engine in a worker process
of its own, holding its models' weights at the run's dtype, its KV space (``VLLM_CPU_KVCACHE_SPACE``, which vLLM's
CPU engine allocates whole) and the process itself (Python, torch, vLLM, a prefill's activations). Where every
engine fits beside the others, in the memory available less a margin for this process, they are held together
(the cell alternates them per chunk); where only one at a time fits, they run one after the other, the baseline's
rows first; where even one does not, the run is refused in one line before anything loads. Only host memory on
the CPU is planned: on a GPU each engine reserves vLLM's ``gpu_memory_utilization`` of the GPU (0.9 by default),
so two never share one, and they run one after the other.

The witness (``OomWitness``): a worker killed by SIGKILL was, more often than not, killed by the OOM killer; the
kernel log (``dmesg``, else ``/dev/kmsg``) and the memory cgroup's ``oom_kill`` count say so where they can be
read. Reading them is best effort: a short timeout, and no error ever escapes.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from mars_bench.models.placement import DTYPES

GIB = 2**30
# The worker's own memory beyond its weights and KV space (Python, torch, vLLM, loading transients, a prefill's
# activations), a fit to the anonymous resident peaks of vllm-cpu 0.32.0 workers measured on the Intel Xeon (AMX),
# fp32, KV space as given, a prefill of about 2,000 tokens then 16 tokens (benchmarks/vllm_worker_memory.py; its
# output in benchmarks/results/vllm_fp32_embedded_cpu/worker_memory.json):
#   SmolLM2-135M, 0.5 GiB of weights, 1 GiB KV: 2.6 GiB peak, 1.1 GiB of its own;
#   the 1.5B target alone, 6.6 GiB, 4 GiB KV: 13.9 GiB peak, 3.3 GiB of its own;
#   the 1.5B target with its 0.5B draft model, 9.0 GiB, 4 GiB KV: 17.1 GiB peak, 4.2 GiB of its own.
# 1 GiB + 0.4 x the weights covers all three (1.2, 3.6, 4.6 GiB).
WORKER_BASE = 1 * GIB
WORKER_PER_WEIGHT = 0.4


def worker_overhead(weights: int) -> int:
    """Bytes a worker holds beyond ``weights`` (bytes) and its KV space (see ``WORKER_BASE``)."""
    return WORKER_BASE + int(WORKER_PER_WEIGHT * weights)


HARNESS_MARGIN = 1 * GIB  # this process grows while it runs (records, outputs, the scorer's sandboxes)


@dataclass(frozen=True)
class EngineFigures:
    """What one vLLM engine (one worker process) holds in host memory, in bytes."""

    label: str  # the method it runs (``baseline`` or the verifier's name)
    weights: int  # every model it loads (the target; the method's draft model or EAGLE head) at the run's dtype
    kv_space: int  # its KV cache (``VLLM_CPU_KVCACHE_SPACE``)
    overhead: int  # the worker process itself (``worker_overhead``)

    @property
    def need(self) -> int:
        return self.weights + self.kv_space + self.overhead


@dataclass(frozen=True)
class MemoryFigures:
    """The figures a plan is made from (bytes). ``engines``: in the order they would run one at a time (the
    baseline first); ``available``: what the machine (or its memory cgroup) has free now; ``harness``: kept for
    this process; ``dtype``: the weights' (``model.dtype``); ``on_cpu``: vLLM runs on the CPU (a ``vllm-cpu``
    environment), so its engines live in host memory."""

    engines: tuple[EngineFigures, ...]
    available: int
    harness: int
    dtype: str
    on_cpu: bool = True


@dataclass(frozen=True)
class MemoryPlan:
    """Whether the engines may be held together (False: one after the other), and why, in one line."""

    together: bool
    line: str


def gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB"


def plan_memory(figures: MemoryFigures) -> MemoryPlan:
    """Together, one after the other, or (ValueError, one line naming the figures) not at all; see the module."""
    if not figures.on_cpu:
        gpu = "vLLM memory: vLLM runs on a GPU, so host memory is not planned"
        if len(figures.engines) == 1:
            return MemoryPlan(True, f"{gpu}; one engine")
        return MemoryPlan(False, f"{gpu}; each engine reserves vLLM's gpu_memory_utilization of the GPU, so they run "
                                 "one after the other")  # fmt: skip
    room = figures.available - figures.harness
    largest = max(figures.engines, key=lambda engine: engine.need)
    if largest.need > room:
        smaller = "model.dtype=bfloat16 halves the weights, " if figures.dtype == "float32" else ""
        raise ValueError(f"vLLM's {largest.label} engine needs {gib(largest.need)} of memory (weights {gib(largest.weights)} "
                         f"in {figures.dtype}, KV space {gib(largest.kv_space)}, the worker {gib(largest.overhead)}), "
                         f"more than the {gib(room)} available ({gib(figures.available)} free less {gib(figures.harness)} "
                         f"for this process): allowed is an engine that fits ({smaller}a smaller VLLM_CPU_KVCACHE_SPACE "
                         "shrinks the KV space)")  # fmt: skip
    needs = " + ".join(f"{engine.label} {gib(engine.need)}" for engine in figures.engines)
    total = sum(engine.need for engine in figures.engines)
    if len(figures.engines) == 1:
        return MemoryPlan(True, f"vLLM memory: the {largest.label} engine needs {gib(total)} of the {gib(room)} available")
    if total <= room:
        return MemoryPlan(True, f"vLLM memory: the engines need {needs} = {gib(total)}, within the {gib(room)} "
                                "available: they run together")  # fmt: skip
    first = figures.engines[0].label
    return MemoryPlan(False, f"vLLM memory: the engines need {needs} = {gib(total)}, more than the {gib(room)} "
                             f"available: they run one after the other, the {first} engine's rows first")  # fmt: skip


# --- the figures, read from the machine -----------------------------------------------------------


def parameter_count(folder: Path) -> int:
    """The parameters of the checkpoint in ``folder``: from its safetensors headers (shapes, whatever their dtype; a
    head tied to the embeddings once); without safetensors, its weight files' bytes over the bytes of the dtype its
    config names (float32 if none)."""
    config = folder / "config.json"
    stored = json.loads(config.read_text()) if config.is_file() else {}
    skipped = {"__metadata__", *(["lm_head.weight"] if stored.get("tie_word_embeddings") else [])}  # tied: one copy
    count = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        count += sum(math.prod(tensor["shape"]) for name, tensor in header.items() if name not in skipped)
    if count:
        return count
    named = str(stored.get("torch_dtype") or stored.get("dtype"))
    width = dtype_bytes(named) if named in DTYPES else 4
    return sum(path.stat().st_size for pattern in ("*.bin", "*.pt", "*.pth") for path in folder.glob(pattern)) // width


def weight_bytes(folders: list[Path], dtype: str) -> int:
    """The bytes the checkpoints in ``folders`` take loaded at ``dtype`` (``dtype_bytes``)."""
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype} is invalid: allowed are {', '.join(DTYPES)}")
    return sum(parameter_count(folder) for folder in folders) * dtype_bytes(dtype)


def dtype_bytes(dtype: str) -> int:
    """Bytes per weight at ``dtype`` (``model.dtype``: one of ``placement.DTYPES``)."""
    return DTYPES[dtype].itemsize


def kv_space(value: str) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, as vLLM's CPU engine reads it) in bytes."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={value} is invalid: allowed is a whole number of GiB >= 1")
    return int(value) * GIB


CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),  # v2
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                 "total_inactive_file"))  # v1  # fmt: skip


def cgroup_room() -> int | None:
    """Bytes this process's memory cgroup may still take (its limit less what it holds, reclaimable file pages
    aside), None where it sets no limit or none can be read (cgroup v2, else v1, as mounted in this container)."""
    root = Path("/sys/fs/cgroup")
    for limit_file, usage_file, stat_file, inactive in CGROUP_FILES:
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:
                continue
            stat = dict(line.split() for line in (root / stat_file).read_text().splitlines())
            return max(int(limit) - int((root / usage_file).read_text()) + int(stat.get(inactive, 0)), 0)
        except (OSError, ValueError):
            continue
    return None


def available_memory() -> int:
    """Bytes free for new processes now: the machine's available memory, or its memory cgroup's room where less."""
    available = psutil.virtual_memory().available
    room = cgroup_room()
    return available if room is None else min(available, room)


# --- after a worker died: was it the OOM killer? ---------------------------------------------------

KILL_LINE = re.compile(r"Killed process (\d+)|oom-kill:.*\bpid=(\d+)")


def kernel_log() -> list[str] | None:
    """The kernel's log lines (``dmesg``, else ``/dev/kmsg`` read without blocking), None where neither can be read."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=3, check=False)
        if done.returncode == 0:
            return done.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        descriptor = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    lines: list[str] = []
    try:
        while len(lines) < 100_000:
            try:
                lines.append(os.read(descriptor, 8192).decode(errors="replace").split(";", 1)[-1].strip())
            except BrokenPipeError:  # a record overwritten while read: go on with the next
                continue
            except BlockingIOError:  # the end of the log
                break
    except OSError:
        return None if not lines else lines
    finally:
        os.close(descriptor)
    return lines


def oom_kills() -> int | None:
    """How many processes the OOM killer killed in this process's memory cgroup (``oom_kill``), None where unread."""
    for name in ("memory.events", "memory/memory.oom_control"):
        try:
            fields = dict(line.split() for line in (Path("/sys/fs/cgroup") / name).read_text().splitlines())
            return int(fields["oom_kill"])
        except (OSError, ValueError, KeyError):
            continue
    return None


@dataclass(frozen=True)
class OomWitness:
    """What the kernel had said of the OOM killer when a worker started: its kill lines and the cgroup's count."""

    kill_lines: frozenset[str] | None
    cgroup_kills: int | None

    @classmethod
    def now(cls) -> OomWitness:
        """Read now (best effort: any failure reads as unknown)."""
        try:
            lines = kernel_log()
        except Exception:  # noqa: BLE001 - a witness never fails the run
            lines = None
        try:
            kills = oom_kills()
        except Exception:  # noqa: BLE001
            kills = None
        kill_lines = None if lines is None else frozenset(line for line in lines if KILL_LINE.search(line))
        return cls(kill_lines, kills)

    def verdict(self, later: OomWitness, pid: int) -> str:
        """Whether the OOM killer killed process ``pid`` between this reading and ``later``, as a phrase."""
        new = [] if self.kill_lines is None or later.kill_lines is None else sorted(later.kill_lines - self.kill_lines)
        if any(pid in {int(group) for group in KILL_LINE.search(line).groups() if group} for line in new):
            return "the kernel log shows the OOM killer killed it: out of memory"
        if new:
            return "the kernel log shows the OOM killer killed a process meanwhile, most likely this one: out of memory"
        if self.cgroup_kills is not None and later.cgroup_kills is not None and later.cgroup_kills > self.cgroup_kills:
            return "the memory cgroup's OOM killer killed a process meanwhile, most likely this one: out of memory"
        if self.kill_lines is not None and later.kill_lines is not None:
            return "the kernel log shows no OOM kill"
        return "the kernel log could not be read to tell whether the OOM killer did"
