"""Tree structure shared by drafting, the engine and the verifiers.

A tree of N drafted nodes is given by ``parents`` (LongTensor[N], on the CPU except for
``device_tree_structure``): the index of
each node's parent, -1 for a child of the root (the last committed token), in topological
order (every parent before its children). A chain is the tree with parents [-1, 0, 1, ...].
Depth 0 is a child of the root.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def is_chain(parents: torch.Tensor) -> bool:
    return torch.equal(parents.cpu(), torch.arange(-1, parents.shape[0] - 1))


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """LongTensor[N]: 0 for a child of the root, parent's depth + 1 otherwise (shared: read only)."""
    return depths_of(tuple(parents.tolist()))


@lru_cache(maxsize=256)
def depths_of(parents: tuple[int, ...]) -> torch.Tensor:
    """``node_depths`` of a tree given as a tuple, computed once per shape (the engine and the
    verifiers ask for the same step's tree, and a drafter repeats its shapes step after step);
    raises ValueError where a parent does not come before its child."""
    depths = torch.zeros(len(parents), dtype=torch.long)
    for index, parent in enumerate(parents):
        if parent >= index:
            raise ValueError(f"parents[{index}]={parent} is invalid: allowed is -1 or an index below {index} (topological order)")
        if parent >= 0:
            depths[index] = depths[parent] + 1
    return depths


def device_tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depths LongTensor[N], ancestors BoolTensor[N, N]: [i, j] when node j is node i or one of its
    ancestors) of ``parents`` (LongTensor[N]), on its device with no host sync, for a tree whose
    parents need not come to the host. Ancestor sets by path doubling: after r rounds every ancestor
    up to 2^r levels above is marked, and no path is longer than N - 1. Parents are not validated."""
    count = parents.shape[0]
    index = torch.arange(count, device=parents.device)
    ancestors = (index[:, None] == index[None, :]) | (parents[:, None] == index[None, :])
    for _ in range(max(count - 1, 0).bit_length()):
        reach = ancestors.float()
        ancestors = (reach @ reach) > 0
    return ancestors.sum(dim=1) - 1, ancestors


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The 4D attention mask [1, 1, q, kv] a transformers model takes for ``allowed`` [q, kv]
    ([B, 1, q, kv] for a batch's ``allowed`` [B, q, kv]).

    Additive, in the model's dtype (0 = attend, dtype min = blocked): a bool 4D mask is
    silently ignored by eager attention, which adds the mask to the scores (True and False
    become +1 and +0, so nothing is blocked).
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None] if allowed.dim() == 2 else mask[:, None]
