"""Tree drafting: the tree's shape and EAGLE-2 style dynamic expansion.

Trees are given by ``parents`` as described in ``mars_bench/trees.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def _check_count(option: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{option}={value!r} is invalid: allowed is an integer >= {minimum}")


@dataclass(frozen=True)
class TreeSettings:
    """The settings of a tree drafter (its depth is the engine's gamma).

    top_k: children tried per expanded node, and nodes expanded per depth (EAGLE's ``top_k``).
    tree_tokens: the tree's size counted as EAGLE counts it (``total_token``): the root plus
        every drafted node, so ``tree_tokens - 1`` nodes are drafted and verified per step.
    Subclasses set the defaults.
    """

    top_k: int
    tree_tokens: int

    def __post_init__(self) -> None:
        _check_count("drafter.top_k", self.top_k, 1)
        _check_count("drafter.tree_tokens", self.tree_tokens, 2)


@dataclass(frozen=True)
class TreeShape:
    """How a tree drafter grows its tree in one step.

    depth: the most drafted tokens on any path (the tree's depth; ``gamma`` in the config).
    top_k, tree_tokens: the drafter's ``TreeSettings``; ``tree_tokens - 1`` nodes are drafted.
    """

    depth: int
    top_k: int
    tree_tokens: int

    def __post_init__(self) -> None:
        _check_count("gamma (tree depth)", self.depth, 1)
        _check_count("drafter.top_k", self.top_k, 1)
        if isinstance(self.tree_tokens, bool) or not isinstance(self.tree_tokens, int) or self.tree_tokens - 1 < self.depth:
            raise ValueError(
                f"drafter.tree_tokens={self.tree_tokens!r} is invalid for depth {self.depth}: allowed is an integer >= "
                f"depth + 1 = {self.depth + 1} (the root plus at least one node per depth)"
            )

    @property
    def nodes(self) -> int:
        return self.tree_tokens - 1

    @classmethod
    def for_step(cls, max_drafts: int, top_k: int, tree_tokens: int) -> TreeShape:
        """This step's shape: depth ``max_drafts``, capped at ``tree_tokens - 1``.

        A draft-length schedule may ask for more levels than the node budget holds; the budget
        is the verification cost the user configured, so the depth gives way, not the budget.
        """
        return cls(min(max_drafts, tree_tokens - 1), top_k, tree_tokens)


@dataclass
class DraftTree:
    """A tree grown node by node. Lists, indexed by node creation order (parents first).

    tokens: token id per node; parents: parent node (-1 for the root's children);
    scores: log-probability of the path from the root to the node under the drafter;
    probs: the drafter's probability of the node's token given its parent (q).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float, prob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.probs.append(prob)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    def best(self, count: int) -> DraftTree:
        """The ``count`` highest-scoring nodes, renumbered in creation order.

        A child's score never exceeds its parent's (log-probabilities are <= 0) and a stable
        sort keeps a parent before an equal-scoring child, so the kept set contains every
        kept node's ancestors.
        """
        order = sorted(range(len(self)), key=lambda node: -self.scores[node])[:count]
        kept = sorted(order)
        renumber = {old: new for new, old in enumerate(kept)}
        tree = DraftTree()
        for old in kept:
            parent = self.parents[old]
            tree.add(self.tokens[old], renumber[parent] if parent >= 0 else -1, self.scores[old], self.probs[old])
        return tree


def frontier_block(
    tree: DraftTree, frontier: list[int], fed: list[int], committed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a drafter feeds for the ``frontier`` nodes after ``committed`` cached context
    positions and the tree nodes ``fed`` earlier (in that cache order), on the CPU: their
    tokens and position ids (LongTensor[F] each; position = committed + depth) and what each
    may attend to (BoolTensor[F, committed + len(fed) + F]): the whole context, its ancestors
    among ``fed``, and itself."""
    tokens = torch.tensor([tree.tokens[node] for node in frontier])
    positions = torch.tensor([committed + tree.depths[node] for node in frontier])
    slot = {node: index for index, node in enumerate(fed)}
    allowed = torch.zeros(len(frontier), committed + len(fed) + len(frontier), dtype=torch.bool)
    allowed[:, :committed] = True
    for row, node in enumerate(frontier):
        allowed[row, committed + len(fed) + row] = True
        ancestor = tree.parents[node]
        while ancestor >= 0:
            allowed[row, committed + slot[ancestor]] = True
            ancestor = tree.parents[ancestor]
    return tokens, positions, allowed


NextLogprobs = Callable[[DraftTree, list[int]], torch.Tensor]


def expand_tree(root_logprobs: torch.Tensor, next_logprobs: NextLogprobs, shape: TreeShape) -> DraftTree:
    """Grow a tree the way EAGLE-2 does, then keep its best ``shape.nodes`` nodes.

    root_logprobs: FloatTensor[V], the drafter's log-probabilities after the committed context.
    next_logprobs(tree, frontier): FloatTensor[len(frontier), V], the drafter's log-probabilities
        after each frontier node (node ids into ``tree``); one drafter forward per call.
    Every expanded node adds its ``top_k`` most likely children to the tree; of the children
    added at one depth, the ``top_k`` with the highest path log-probability are expanded
    next. ``shape.depth - 1`` calls of ``next_logprobs`` in all (so ``shape.depth`` drafter
    forwards per step, as for a chain of that many drafts). EAGLE's ``depth`` setting counts levels after
    the first, so its depth 6 is depth 7 here.
    """
    tree = DraftTree()
    values, tokens = (t.cpu() for t in torch.topk(root_logprobs.float(), min(shape.top_k, root_logprobs.shape[-1])))
    frontier = [tree.add(t, -1, v, math.exp(v)) for v, t in zip(values.tolist(), tokens.tolist())]
    for _ in range(shape.depth - 1):
        logprobs = next_logprobs(tree, frontier).float()
        child_values, child_tokens = (t.cpu() for t in torch.topk(logprobs, min(shape.top_k, logprobs.shape[-1]), dim=-1))
        totals = torch.tensor([tree.scores[node] for node in frontier])[:, None] + child_values
        children = [
            tree.add(token, frontier[row], total, math.exp(value))
            for row, (row_tokens, row_totals, row_values) in enumerate(
                zip(child_tokens.tolist(), totals.tolist(), child_values.tolist())
            )
            for token, total, value in zip(row_tokens, row_totals, row_values)
        ]
        best = torch.topk(totals.flatten(), min(shape.top_k, totals.numel())).indices.tolist()
        frontier = [children[index] for index in sorted(best)]
    return tree.best(shape.nodes)
