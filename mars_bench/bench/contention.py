"""Did anything else use the machine while a decode was timed?

A timing is only as good as the machine was quiet. The kernel counts the CPU time spent busy on
every core and the time this process and its children used (all their threads); psutil reads both on
any system it supports (``cpu_times``, ``Process().cpu_times()``). Their difference over a timed interval is the
CPU time every *other* process took (and, on a virtual machine, the time the hypervisor stole).
Divided by the interval it is how many cores others kept busy on average: ``other_load``. On CUDA,
NVML (``pynvml``, where installed) reports each process's share of the GPU's streaming
multiprocessors; the largest share another process had is ``other_gpu_util`` (percent). A row
whose ``other_load`` exceeds the threshold (cores) or whose ``other_gpu_util`` exceeds the GPU
threshold is *disturbed*.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from mars_bench.common.engine_processes import adopted

# The busy fields of psutil.cpu_times(), those a system has: Linux counts guest time inside user
# already, and Windows its interrupt and DPC time inside system; idle and iowait are not busy.
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")
DEFAULT_THRESHOLD = 0.25  # cores kept busy by other processes on average
DEFAULT_GPU_THRESHOLD = 10.0  # percent of the GPU's multiprocessors used by another process


def machine_busy_s() -> float | None:
    """Seconds of CPU time all processes used since boot, summed over cores; None where the system
    does not say (psutil cannot read it here)."""
    try:
        times = psutil.cpu_times()
    except (OSError, psutil.Error, NotImplementedError):
        return None
    return sum(getattr(times, field, 0.0) for field in BUSY_FIELDS)


def own_cpu_s() -> float:
    """CPU seconds this process used (user + system, every thread) and the processes it adopted as its own
    work (``common.engine_processes``: ``backend=vllm``'s workers, with their descendants). Other children,
    such as a process a caller started beside the run, are another's."""
    times = psutil.Process().cpu_times()
    total = times.user + times.system
    for pid in adopted():
        try:
            worker = psutil.Process(pid)
            family = [worker, *worker.children(recursive=True)]
        except psutil.Error:  # it ended
            continue
        for process in family:
            try:
                spent = process.cpu_times()
            except psutil.Error:  # it ended between the listing and the read
                continue
            total += spent.user + spent.system
    return total


@dataclass(frozen=True)
class Contention:
    """What other processes used during one timed interval."""

    wall_s: float
    other_cpu_s: float | None  # None: the machine's busy time is not readable here; may dip below 0 by a tick
    other_gpu_util: float | None  # the largest SM share another process had (percent); None: no NVML
    peak_memory_mb: float | None = None  # this process's peak memory in the interval (bench/peak_memory.py)

    @property
    def other_load(self) -> float | None:
        """Cores other processes kept busy on average (0 on an idle machine)."""
        if self.other_cpu_s is None or self.wall_s <= 0:
            return None
        return max(0.0, self.other_cpu_s) / self.wall_s

    def disturbed(self, threshold: float = DEFAULT_THRESHOLD, gpu_threshold: float = DEFAULT_GPU_THRESHOLD) -> bool:
        load, gpu = self.other_load, self.other_gpu_util
        return (load is not None and load > threshold) or (gpu is not None and gpu > gpu_threshold)

    def to_record(self) -> dict[str, Any]:
        load = self.other_load
        return {
            "other_cpu_s": None if self.other_cpu_s is None else round(max(0.0, self.other_cpu_s), 3),
            "other_load": None if load is None else round(load, 3),
            "other_gpu_util": self.other_gpu_util,
            **({} if self.peak_memory_mb is None else {"peak_memory_mb": round(self.peak_memory_mb, 1)}),
        }


class GpuWatch:
    """Other processes' use of the GPUs through NVML (``nvml``: the ``pynvml`` module, initialised);
    inert without it."""

    def __init__(self, nvml: Any = None) -> None:
        self.nvml = nvml
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())] if nvml else []

    @classmethod
    def detect(cls) -> GpuWatch:
        """NVML where CUDA and ``pynvml`` (nvidia-ml-py) are both there, else an inert watch."""
        try:
            import torch

            if not torch.cuda.is_available():
                return cls()
            import pynvml

            pynvml.nvmlInit()
            return cls(pynvml)
        except Exception:  # no pynvml, no driver, no permission: GPU contention is simply not measured
            return cls()

    def now_us(self) -> int:
        return int(time.time() * 1e6)

    def others_peak(self, since_us: int) -> float | None:
        """The largest SM utilisation (percent) any other process had on any device since ``since_us``."""
        if self.nvml is None:
            return None
        peak = 0.0
        for handle in self.handles:
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
            except Exception:  # NVML_ERROR_NOT_FOUND: no process sampled in the window
                continue
            for sample in samples:
                if sample.pid != os.getpid():
                    peak = max(peak, float(sample.smUtil))
        return peak


class ContentionMeter:
    """Measures one interval at a time: ``start()`` before a timed decode, ``stop()`` after it
    (``gpu``: the GPU watch, detected when None)."""

    def __init__(self, gpu: GpuWatch | None = None) -> None:
        self.gpu = gpu if gpu is not None else GpuWatch.detect()
        self.started: tuple[float, float | None, float, int] | None = None

    def start(self) -> None:
        self.started = (time.perf_counter(), machine_busy_s(), own_cpu_s(), self.gpu.now_us())

    def stop(self) -> Contention:
        if self.started is None:
            raise RuntimeError("ContentionMeter.stop() called before start()")
        wall0, busy0, own0, gpu_since = self.started
        busy1, own1 = machine_busy_s(), own_cpu_s()
        wall = time.perf_counter() - wall0
        others = None if busy0 is None or busy1 is None else (busy1 - busy0) - (own1 - own0)
        self.started = None
        return Contention(wall, others, self.gpu.others_peak(gpu_since))

    def sample(self, seconds: float) -> Contention:
        """Contention over the next ``seconds`` while this process waits."""
        self.start()
        time.sleep(seconds)
        return self.stop()

    def wait_until_idle(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        gpu_threshold: float = DEFAULT_GPU_THRESHOLD,
        window_s: float = 1.0,
        max_wait_s: float = 600.0,
    ) -> Contention:
        """Sample ``window_s`` windows until one is undisturbed or ``max_wait_s`` passed; the last window."""
        deadline = time.monotonic() + max_wait_s
        while True:
            window = self.sample(window_s)
            if not window.disturbed(threshold, gpu_threshold) or time.monotonic() >= deadline:
                return window


def machine_load(since: ContentionMeter | None = None, window_s: float = 0.5) -> dict[str, Any]:
    """The machine's load when a run starts: the kernel's load averages and other processes' use since ``since`` was
    started (a cell starts it as it begins, so the window is its loading, and nothing waits), else over the next
    ``window_s`` seconds."""
    try:
        one, five, fifteen = os.getloadavg()
        averages: list[float] | None = [round(one, 2), round(five, 2), round(fifteen, 2)]
    except OSError:
        averages = None
    window = since.stop() if since is not None and since.started is not None else ContentionMeter().sample(window_s)
    return {"loadavg": averages, "cores": os.cpu_count(), "window_s": round(window.wall_s, 3), **window.to_record()}
