"""Lap timer for the engine's phase times (prefill, draft, target forward, verify, bookkeeping).

Units: every ``lap()`` returns seconds (a float) since the previous lap (or since the clock
was made). CUDA devices are timed with CUDA events, everything else with
``time.perf_counter``.
"""

from __future__ import annotations

import time

import torch


class Clock:
    """``Clock(device).lap()``: seconds elapsed since the last lap, device work included.

    On a CUDA device each lap records an event on the device's current stream, waits for that
    event (so the work queued before the lap has finished) and returns the time between the
    previous lap's event and this one (``Event.elapsed_time`` gives milliseconds; the clock
    returns seconds). Events time the stream on the clock's own device: for a target sharded
    over several GPUs, make the clock on its input device, where accelerate returns the
    logits, so the copy back orders every shard's work before the event.
    On the CPU (or any other device) a lap reads ``time.perf_counter`` (no device sync).
    """

    def __init__(self, device: torch.device | str | int = "cpu") -> None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        if self.cuda:
            self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
            self._last_event = self._record()
        else:
            self.device = device
            self._last_time = time.perf_counter()

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def lap(self) -> float:
        """Seconds since the previous lap (or since the clock was made)."""
        if self.cuda:
            event = self._record()
            event.synchronize()
            elapsed = self._last_event.elapsed_time(event) / 1000.0
            self._last_event = event
            return elapsed
        current = time.perf_counter()
        elapsed, self._last_time = current - self._last_time, current
        return elapsed
