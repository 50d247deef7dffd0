"""Forward costs: measured in isolation, summed inside a decode, and the analytic speedup they predict."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import numpy as np
import torch

from mars_bench.models.kvcache import cached_logits, crop_to, new_cache
from mars_bench.models.placement import input_device


def synced_time(device: torch.device) -> float:
    """``time.perf_counter()``, after a CUDA sync when ``device`` is a GPU (its queued work done)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class ForwardTimer:
    """Wall seconds spent inside the top-level forward calls of ``models`` while in the block.

    Hooks wrap each call (``model(...)``, which is how the engine and the drafters run a
    model); on a GPU they synchronise, which slows the timed run a little. Everything else
    in the block (drafting logic, sampling, verification, cache bookkeeping) is time outside
    model forwards. ``forwards``: (tokens fed per row, seconds) of each call, in order.
    """

    def __init__(self, *models: Any) -> None:
        self.models = models
        self.forwards: list[tuple[int, float]] = []
        self._handles: list[Any] = []
        self._devices: dict[int, torch.device] = {}  # id(model) -> its input device, resolved once per block
        self._started = 0.0
        self._width = 0

    def _start(self, model: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._width = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
        self._started = synced_time(self._devices[id(model)])

    def _stop(self, model: Any, args: Any, output: Any) -> None:
        self.forwards.append((self._width, synced_time(self._devices[id(model)]) - self._started))

    @property
    def calls(self) -> int:
        return len(self.forwards)

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.forwards)

    def __enter__(self) -> ForwardTimer:
        self._devices = {id(model): input_device(model) for model in self.models}
        for model in self.models:
            self._handles += [model.register_forward_pre_hook(self._start, with_kwargs=True),
                              model.register_forward_hook(self._stop)]  # fmt: skip
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@torch.inference_mode()
def forward_seconds(model: Any, context: int, width: int, repeats: int = 10) -> float:
    """Median seconds of one cached forward of ``width`` new tokens after ``context`` cached ones
    (logits for every new token, as verification needs)."""
    device = input_device(model)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (context + width,), generator=torch.Generator().manual_seed(0)).to(device)
    cache = new_cache(model)
    cached_logits(model, tokens[:context], cache, last_only=True)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        crop_to(cache, context)
        start = synced_time(device)
        cached_logits(model, tokens[context:], cache)
        times.append(synced_time(device) - start)
    return statistics.median(times[1:])


def calibrated_costs(forwards: Iterable[tuple[int, float]], widths: Iterable[int]) -> dict[int, float]:
    """Seconds of one forward by tokens fed, for each of ``widths``, from timed forwards ((tokens fed, seconds)
    pairs, e.g. a decode's own, its prefill left out): the median at each width fed, then the least-squares
    line through those medians (weighted by how many forwards each holds), so a width fed rarely or never is
    priced by the others. One width fed: its median everywhere."""
    by_width: dict[int, list[float]] = {}
    for width, seconds in forwards:
        by_width.setdefault(int(width), []).append(seconds)
    if not by_width:
        raise ValueError("no forwards to calibrate from")
    fed = sorted(by_width)
    medians = [statistics.median(by_width[width]) for width in fed]
    if len(fed) == 1:
        return {width: medians[0] for width in widths}
    slope, intercept = np.polyfit(fed, medians, 1, w=[len(by_width[width]) ** 0.5 for width in fed])
    return {width: float(intercept + slope * width) for width in widths}


def predicted_step_speedup(
    emitted: int, step_drafts: list[int], target_s: dict[int, float], draft_one: float, one_token_s: float | None = None
) -> float:
    """Tokens per second of chain speculative decoding over autoregressive decoding when only
    forwards cost time, for the steps a decode took: step i drafts ``step_drafts[i]`` tokens (one
    drafter forward each, at ``draft_one`` seconds) and runs one target forward over them plus the
    root (``target_s[width]`` seconds for ``width`` tokens); the steps emit ``emitted`` tokens,
    which autoregressive decoding would make at ``one_token_s`` seconds each (default ``target_s[1]``).
    With a fixed draft length d and tau tokens per step this is tau * target_s[1] / (d * draft_one + target_s[d + 1])."""
    step_seconds = sum(drafts * draft_one + target_s[drafts + 1] for drafts in step_drafts)
    return emitted * (target_s[1] if one_token_s is None else one_token_s) / step_seconds


def capped_step_speedups(
    steps: list[tuple[int, int, int]], target_s: dict[int, float], draft_one: float, one_token_s: float | None = None
) -> dict[int, float]:
    """Per cap k on the drafts of a step (1 to the deepest step drafted): the speedup over autoregressive
    decoding that the forward costs predict for the steps a decode took, each step cut at k. ``steps``:
    (drafted, accepted, emitted) per step; cut at k, a step drafts min(drafted, k) tokens and, where it
    accepted more than k, emits k + 1 (else what it emitted: a stop or the budget may have cut it), so
    at the decode's own cap this is ``predicted_step_speedup``. An approximation: a cap changes where
    later steps start, which the cut steps do not see, and it cannot look past the deepest draft the
    decode made (nor past the widths timed)."""
    deepest = min(max((drafted for drafted, _, _ in steps), default=0), max(target_s) - 1)
    speedups = {}
    for cap in range(1, deepest + 1):
        emitted = sum(cap + 1 if accepted > cap else tokens for _, accepted, tokens in steps)
        drafts = [min(drafted, cap) for drafted, _, _ in steps]
        speedups[cap] = predicted_step_speedup(emitted, drafts, target_s, draft_one, one_token_s)
    return speedups
