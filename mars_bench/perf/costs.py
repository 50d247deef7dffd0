"""Forward costs measured in isolation, and the analytic speedup they predict."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.kvcache import cached_logits, crop_to
from mars_bench.models import input_device


@torch.inference_mode()
def forward_seconds(model: Any, context: int, width: int, repeats: int = 10) -> float:
    """Median seconds of one cached forward of ``width`` new tokens after ``context`` cached ones
    (logits for every new token, as verification needs)."""
    device = input_device(model)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (context + width,), generator=torch.Generator().manual_seed(0)).to(device)
    cache = DynamicCache(config=model.config)
    cached_logits(model, tokens[:context], cache, last_only=True)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        crop_to(cache, context)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        cached_logits(model, tokens[context:], cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def predicted_speedup(tau: float, drafts_per_step: float, target_one: float, target_verify: float, draft_one: float) -> float:
    """Tokens per second of chain speculative decoding over autoregressive decoding when only
    forwards cost time: each step drafts ``drafts_per_step`` tokens (one drafter forward each),
    runs one target forward over them plus the root, and emits ``tau`` tokens; autoregressive
    decoding emits one token per ``target_one`` seconds."""
    return tau * target_one / (drafts_per_step * draft_one + target_verify)
