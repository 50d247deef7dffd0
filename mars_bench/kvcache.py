"""Cached forwards and KV-cache rollback, shared by the engine and the model drafters."""

from __future__ import annotations

from typing import Any

import torch


def crop_to(cache: Any, length: int) -> None:
    """Drop cached positions past ``length`` (transformers 5 ``crop`` takes a negative count)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def cached_logits(model: Any, tokens: torch.Tensor, cache: Any, *, last_only: bool = False) -> torch.Tensor:
    """Logits [n, V] for ``tokens`` (LongTensor[n]) appended to ``cache``; [1, V] if ``last_only``.

    ``last_only`` passes the last index as a tensor: an integer ``logits_to_keep`` slices a
    non-contiguous view of the hidden states, which sends the head's matmul down a batched
    path that copies the whole [hidden, vocab] weight on every multi-token call (measured:
    410 ms per call for the 0.5B drafter on this CPU).
    """
    device = model.get_input_embeddings().weight.device
    keep = torch.tensor([tokens.shape[0] - 1], device=device) if last_only else 0
    out = model(input_ids=tokens[None].to(device), cache=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[0]
