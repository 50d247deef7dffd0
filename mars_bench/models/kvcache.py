"""The KV cache: its one constructor, cached forwards (chain, tree, a batch of rows) and every
surgery on it (rollback, keeping a tree's accepted path, masking, dropping rows), shared by the
engine and the drafters. Nothing else in mars_bench builds or edits a model's cache; the EAGLE-3 head keeps a
one-layer cache of its own, its own tensors (``drafting/eagle3/head.py``).

transformers' ``DynamicCache`` keeps per layer ``keys`` and ``values`` [B, kv_heads, S, head_dim];
``crop`` takes a negative count, and positions are selected by editing those public tensors
(``../shared/reference/transformers-5.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.common.trees import additive_mask, device_tree_structure
from mars_bench.models.placement import input_device


def new_cache(model: Any) -> Any:
    """An empty KV cache for ``model`` (one layer per decoder layer of its config)."""
    return DynamicCache(config=model.config)


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


def mask_dtype(model: Any) -> torch.dtype:
    """The dtype of ``model``'s additive attention masks: its embeddings' (see ``additive_mask``)."""
    return model.get_input_embeddings().weight.dtype


def masked_forward(
    model: Any,
    cache: Any,
    tokens: torch.Tensor,
    allowed: torch.Tensor,
    positions: torch.Tensor,
    *,
    logits_to_keep: int = 0,
    hidden_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [B, n, V] (the last ``logits_to_keep`` slots' if > 0) for ``tokens`` [B, n] appended to a
    batch's ``cache``, with what each slot attends to (``allowed`` BoolTensor[B, n, S + n]: the S cached
    positions, then the n new slots) and its position id (``positions`` LongTensor[B, n]); and the
    ``hidden_layers`` entries of the hidden states concatenated along the hidden axis ([B, n, F], None
    if none asked). All on the model's input device, where the 4D additive mask is built.
    """
    count = tokens.shape[1]
    # As in cached_forward: the kept slots as a tensor, since an integer slices a view that sends the head down a slow path.
    keep = torch.arange(count - logits_to_keep, count, device=tokens.device) if logits_to_keep else 0
    extra: dict[str, Any] = {"output_hidden_states": list(hidden_layers)} if hidden_layers else {}
    out = model(input_ids=tokens, attention_mask=additive_mask(allowed, mask_dtype(model), tokens.device),
                position_ids=positions, cache=cache, use_cache=True, logits_to_keep=keep, **extra)  # fmt: skip
    device = tokens.device
    features = torch.cat([out.hidden_states[i].to(device) for i in hidden_layers], dim=-1) if hidden_layers else None
    return out.logits, features


def block_layout(fed: torch.Tensor, parents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What each of a batch's n new slots attends to among them (BoolTensor[B, n, n]) and its depth in
    the block (LongTensor[B, n]), on ``fed``'s device; ``fed`` BoolTensor[B, n] marks the real slots.

    parents: None, every row a chain (each real slot sees the real slots up to itself; depth = slot);
    else LongTensor[B, n], each slot's parent slot within its row (-1: it follows the cached prefix;
    parents before children), any device: each real slot sees its ancestors and itself. A padded
    slot is seen by no slot.
    """
    count = fed.shape[1]
    if parents is None:
        causal = torch.ones(count, count, dtype=torch.bool, device=fed.device).tril()
        return causal[None] & fed[:, None, :], (fed.long().cumsum(dim=1) - 1).clamp(min=0)
    depths, ancestors = batch_tree_structure(parents.to(fed.device))
    return ancestors & fed[:, None, :], depths


def batch_tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``device_tree_structure`` of each row of ``parents`` (LongTensor[B, n]): (depths [B, n], ancestors
    [B, n, n]), on its device with no host sync (path doubling, one batched matmul per round)."""
    count = parents.shape[-1]
    index = torch.arange(count, device=parents.device)
    ancestors = (index[:, None] == index[None, :]) | (parents[:, :, None] == index)
    for _ in range(max(count - 1, 0).bit_length()):
        reach = ancestors.float()
        ancestors = (reach @ reach) > 0
    return ancestors.sum(dim=-1) - 1, ancestors


def batch_forward(
    model: Any, cache: Any, attended: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor, logits_to_keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, n, V] (the last ``logits_to_keep`` slots' if > 0) for chains of ``tokens`` [B, n]
    appended to a batch's ``cache``, and the cached positions each row attends to afterwards.

    attended: BoolTensor[B, cached], the cached positions each row sees (a rejected draft's
    position is masked, not removed: ``BatchCache``). fed: BoolTensor[B, n], the real (not padded)
    slots; each attends to its row's attended positions and the real slots before it, and a padded
    slot is attended by nothing. A real slot's position id counts the positions its row attends to
    before it, so a row's rotary positions are those it would have alone.
    """
    block, depths = block_layout(fed)
    allowed = torch.cat([attended[:, None, :].expand(-1, tokens.shape[1], -1), block], dim=2)
    positions = attended.long().sum(dim=1, keepdim=True) + depths
    logits, _ = masked_forward(model, cache, tokens, allowed, positions, logits_to_keep=logits_to_keep)
    return logits, torch.cat([attended, fed], dim=1)


def padded_rows(
    rows: Sequence[torch.Tensor | Sequence[int]], left: bool, pad: int = 0, device: torch.device | str = "cpu"
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


def gather_block(cache: Any, start: int, slots: torch.Tensor) -> None:
    """Move each row's ``slots`` (LongTensor[B, k], positions after ``start``, ascending per row) to
    positions ``start .. start + k - 1`` of every layer, in place (the cache keeps its length).

    A tree's accepted path this way follows the prefix with no copy of the prefix: transformers
    appends each forward's keys and values to fresh tensors, so the block is written in place.
    """
    on_device: dict[torch.device, torch.Tensor] = {}
    width = slots.shape[1]
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if keys.device not in on_device:  # the index goes to each device once, not once per layer
            on_device[keys.device] = slots.to(keys.device)[:, None, :, None]
        index = on_device[keys.device].expand(-1, keys.shape[1], -1, keys.shape[-1])
        keys[:, :, start : start + width] = keys[:, :, start:].gather(2, index)  # the gather copies first
        values[:, :, start : start + width] = values[:, :, start:].gather(2, index)


class BatchCache:
    """The KV cache of B rows decoded together, and which cached positions each row attends to.

    The rows are left-padded at the prefill. After each forward a row keeps some of its new slots
    (``commit``): a chain's first ones, a tree's root and accepted path, which are gathered to the
    front of the block. The slots a row does not keep are masked for it, not removed, and the
    positions no row keeps are cropped, so no step copies the cached prefix. The engine keeps the
    target's cache so, and a model drafter its draft model's, which also ``forget``s a row's drafts
    of earlier forwards once the verdict rejects them.

    One row with nothing masked (every batch begun with one row: a chain keeps its first slots, a tree's
    path is gathered, a one-row prefill has no padding, and what it forgets is its newest; not a batch
    that shrank to one row, whose masked slots stay) is ``dense``: it crops instead of masking and runs
    the plain cached forward, causal for a chain and tree-masked for a tree, with no attention mask to build.
    attended: BoolTensor[B, S] on the model's input device, the cached positions each row sees (None
    while dense: all of them).
    """

    def __init__(self, model: Any, rows: int) -> None:
        self.model, self.device = model, input_device(model)
        self.cache = new_cache(model)
        self.dense = rows == 1
        self.attended: torch.Tensor | None = None if self.dense else torch.zeros(rows, 0, dtype=torch.bool, device=self.device)
        self.block_start = 0  # cached positions before the last forward's slots

    @property
    def length(self) -> int:
        """Cached positions, masked ones included."""
        return int(self.cache.get_seq_length())

    @property
    def attending(self) -> torch.Tensor:
        """BoolTensor[B, S] on the device: the cached positions each row attends to (all of them while dense)."""
        if self.dense:
            return torch.ones(1, self.length, dtype=torch.bool, device=self.device)
        return self.attended

    def forward(
        self,
        tokens: torch.Tensor,
        fed: torch.Tensor | None = None,
        parents: torch.Tensor | None = None,
        *,
        logits_to_keep: int = 0,
        hidden_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, n, V] (the last ``logits_to_keep`` slots' if > 0) and the ``hidden_layers``
        features [B, n, F] (None if none asked) of ``tokens`` [B, n] appended to the cache.

        fed: BoolTensor[B, n] on the device, the real slots (None: all). parents: None for chains,
        else LongTensor[B, n] (any device), each slot's parent slot within its row (``block_layout``).
        """
        self.block_start = self.length
        if self.dense:
            tree = None if parents is None else parents[0]
            logits, features = cached_forward(self.model, tokens[0], self.cache, keep_last=logits_to_keep, parents=tree,
                                              hidden_layers=hidden_layers)  # fmt: skip
            return logits[None], None if features is None else features[None]
        fed = torch.ones_like(tokens, dtype=torch.bool) if fed is None else fed
        block, depths = block_layout(fed, parents)
        allowed = torch.cat([self.attended[:, None, :].expand(-1, tokens.shape[1], -1), block], dim=2)
        positions = self.attended.long().sum(dim=1, keepdim=True) + depths
        logits, features = masked_forward(self.model, self.cache, tokens, allowed, positions,
                                          logits_to_keep=logits_to_keep, hidden_layers=hidden_layers)  # fmt: skip
        self.attended = torch.cat([self.attended, fed], dim=1)
        return logits, features

    def commit(self, kept: Sequence[Sequence[int]]) -> None:
        """Each row keeps the slots ``kept[b]`` of the last forward (ascending; a prefix for a chain);
        the others are masked for it, and the positions past every row's kept slots are cropped."""
        start, width = self.block_start, max(len(slots) for slots in kept)
        if any(list(slots) != list(range(len(slots))) for slots in kept):  # a tree's path: gather it to the front
            padded = [list(slots) + [slots[-1]] * (width - len(slots)) for slots in kept]
            gather_block(self.cache, start, torch.tensor(padded, dtype=torch.long))
        crop_to(self.cache, start + width)
        if not self.dense:
            counts = torch.tensor([len(slots) for slots in kept], device=self.device)
            block = torch.arange(width, device=self.device)[None] < counts[:, None]
            self.attended = torch.cat([self.attended[:, :start], block], dim=1)

    def forget(self, positions: Sequence[Sequence[int]], length: int) -> None:
        """Row b no longer attends to its cached ``positions[b]`` (forwards before the last included), and the
        positions from ``length`` on, which no row attends to any more, are cropped. A dense cache can only crop:
        every position it forgets must be >= ``length`` (a drafter's rejected drafts are its newest)."""
        if not self.dense:
            forget = torch.zeros(self.attended.shape, dtype=torch.bool)
            for row, columns in enumerate(positions):
                forget[row, list(columns)] = True
            self.attended = self.attended & ~forget.to(self.device)
        self.crop(length)

    def crop(self, length: int) -> None:
        """Drop the cached positions from ``length`` on (no row attends to them)."""
        crop_to(self.cache, length)
        if not self.dense:
            self.attended = self.attended[:, :length]

    def keep_rows(self, rows: list[int]) -> None:
        """Only the rows ``rows`` (indices into the current batch) stay."""
        if self.dense:
            return
        self.attended = select_batch_rows(self.cache, self.attended, rows)
