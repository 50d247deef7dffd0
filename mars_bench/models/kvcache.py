"""Cached forwards (chain and tree) and KV-cache rollback, shared by the engine and the drafters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mars_bench.common.trees import additive_mask, device_tree_structure
from mars_bench.models.placement import input_device


def crop_to(cache: Any, length: int) -> None:
    """Drop cached positions past ``length`` (transformers 5 ``crop`` takes a negative count)."""
    surplus = cache.get_seq_length() - length
    if surplus > 0:
        cache.crop(-surplus)


def keep_positions(cache: Any, positions: torch.Tensor) -> None:
    """Keep only the cached ``positions`` (LongTensor, ascending) in every layer, in that order.

    After a tree forward this keeps the prefix and the accepted path (transformers has no
    API for selecting sequence positions; the layers' key and value tensors are public).
    The index goes to each device once, not once per layer (a host copy syncs a GPU).
    """
    on_device: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        device = layer.keys.device
        if device not in on_device:
            on_device[device] = positions.to(device)
        layer.keys = layer.keys.index_select(-2, on_device[device])
        layer.values = layer.values.index_select(-2, on_device[device])


TREE_ATTENTION = ("eager", "sdpa")  # the attention implementations that apply a 4D additive mask as given


def check_tree_attention(model: Any) -> None:
    """Raise ValueError unless ``model`` attends with an implementation that honours a tree mask."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in TREE_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} cannot verify or draft trees: allowed are {', '.join(TREE_ATTENTION)}"
        )


def tree_attention(parents: torch.Tensor, past_len: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of n new tokens laid out as a tree over ``past_len`` cached ones may attend
    to (BoolTensor[n, past_len + n]: the whole prefix, its ancestors and itself) and its
    position id (LongTensor[n]: past_len + depth), built on ``device``.

    parents: LongTensor[n] (any device), each token's parent within the block, -1 for a
    token that follows the cached prefix directly; parents come before their children.
    """
    depths, ancestors = device_tree_structure(parents.to(device))
    prefix = torch.ones(parents.shape[0], past_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, ancestors], dim=1), past_len + depths


def cached_forward(
    model: Any,
    tokens: torch.Tensor,
    cache: Any,
    *,
    last_only: bool = False,
    keep_last: int = 0,
    parents: torch.Tensor | None = None,
    attention: tuple[torch.Tensor, torch.Tensor] | None = None,
    hidden_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [n, V] for ``tokens`` (LongTensor[n]) appended to ``cache`` ([1, V] if
    ``last_only``), and the ``hidden_layers`` entries of the model's hidden states for the
    new tokens concatenated along the hidden axis ([n, len * hidden]; None if none asked).
    keep_last: logits for the last ``keep_last`` tokens only ([keep_last, V]); ``last_only`` is 1.

    parents: None for a chain; else the tokens' tree within the block (see ``tree_attention``),
    run in one forward with a 4D mask and per-node positions.
    attention: (allowed [n, cached + n] bool, positions [n]) for any other layout, such as a
    tree drafter's frontier over the nodes it fed earlier.

    ``last_only`` passes the last index as a tensor: an integer ``logits_to_keep`` slices a
    non-contiguous view of the hidden states, which sends the head's matmul down a batched
    path that copies the whole [hidden, vocab] weight on every multi-token call (measured:
    410 ms per call for the 0.5B drafter on this CPU).
    """
    device = input_device(model)
    keep_last = 1 if last_only else keep_last
    count = int(tokens.shape[0])
    keep = torch.arange(count - keep_last, count, device=device) if keep_last else 0
    extra: dict[str, Any] = {}
    if parents is not None:
        attention = tree_attention(parents, cache.get_seq_length(), device)
    if attention is not None:
        check_tree_attention(model)
        allowed, positions = attention
        extra["attention_mask"] = additive_mask(allowed, model.get_input_embeddings().weight.dtype, device)
        extra["position_ids"] = positions[None].to(device)
    if hidden_layers:
        extra["output_hidden_states"] = list(hidden_layers)
    out = model(input_ids=tokens[None].to(device), cache=cache, use_cache=True, logits_to_keep=keep, **extra)
    features = torch.cat([out.hidden_states[i][0].to(device) for i in hidden_layers], dim=-1) if hidden_layers else None
    return out.logits[0], features


def cached_logits(model: Any, tokens: torch.Tensor, cache: Any, *, last_only: bool = False, keep_last: int = 0) -> torch.Tensor:
    """Logits only: ``cached_forward`` for a chain with no hidden states."""
    return cached_forward(model, tokens, cache, last_only=last_only, keep_last=keep_last)[0]


def batch_forward(
    model: Any, cache: Any, attended: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor, logits_to_keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, n, V] (the last ``logits_to_keep`` slots' if > 0) for ``tokens`` [B, n] appended to a
    batch's ``cache``, and the cached positions each row attends to afterwards.

    attended: BoolTensor[B, cached], the cached positions each row sees (a rejected draft's
    position is masked, not removed: ``decoding/batched.py``). fed: BoolTensor[B, n], the real
    (not padded) slots; each attends to its row's attended positions and the real slots before it,
    and a padded slot is attended by nothing. A real slot's position id counts the positions its row
    attends to before it, so a row's rotary positions are those it would have alone. All on the
    model's device, where the 4D additive mask and the positions are built.
    """
    count = tokens.shape[1]
    causal = torch.ones(count, count, dtype=torch.bool, device=tokens.device).tril()
    allowed = torch.cat([attended[:, None, :].expand(-1, count, -1), causal[None] & fed[:, None, :]], dim=2)
    mask = additive_mask(allowed, model.get_input_embeddings().weight.dtype, tokens.device)
    positions = attended.long().sum(dim=1, keepdim=True) + (fed.long().cumsum(dim=1) - 1).clamp(min=0)
    # As in cached_forward: the kept slots as a tensor, since an integer slices a view that sends the head down a slow path.
    keep = torch.arange(count - logits_to_keep, count, device=tokens.device) if logits_to_keep else 0
    out = model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                logits_to_keep=keep)  # fmt: skip
    return out.logits, torch.cat([attended, fed], dim=1)


def padded_rows(
    rows: list[torch.Tensor], left: bool, pad: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as one batch: (tokens LongTensor[B, n], fed BoolTensor[B, n]),
    on ``device``; each row left-padded (a prefill: every row ends at the last slot) or right-padded."""
    width = max((len(row) for row in rows), default=0)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    fed = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        slots = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[index, slots] = torch.as_tensor(row, dtype=torch.long)
        fed[index, slots] = True
    return tokens.to(device), fed.to(device)


def select_batch_rows(cache: Any, attended: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Keep only ``rows`` of a batch's cache (in place) and of ``attended`` (returned)."""
    if len(rows) == attended.shape[0]:
        return attended
    selected = torch.tensor(rows, dtype=torch.long, device=attended.device)
    cache.batch_select_indices(selected)
    return attended.index_select(0, selected)


def crop_batch(cache: Any, attended: torch.Tensor, length: int) -> torch.Tensor:
    """Drop a batch's cached positions past ``length`` (no row attends to them); returns ``attended`` cut to match."""
    crop_to(cache, length)
    return attended[:, :length]
