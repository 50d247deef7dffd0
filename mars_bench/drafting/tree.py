"""Tree drafting: the tree's shape and EAGLE-2 style dynamic expansion.

Trees are given by ``parents`` as described in ``mars_bench/common/trees.py``. A tree grows in
fixed-shape tensors on the drafter's device, its sizes planned from its shape alone, so the
expansion never waits for the device; the finished tree reaches the host in one transfer
(``DraftedTree.to_draft``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mars_bench.drafting.base import Draft


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


@dataclass(frozen=True)
class TreePlan:
    """The sizes of one step's tree, fixed by its shape and the vocabulary (never by values).

    added: nodes added at each depth (depth 0: the root's children).
    fed: frontier nodes fed to the drafter at each depth but the last.
    children: children tried per expanded node (top_k capped at the vocabulary).
    """

    added: tuple[int, ...]
    fed: tuple[int, ...]
    children: int

    @property
    def capacity(self) -> int:
        return sum(self.added)


def tree_plan(shape: TreeShape, vocab: int) -> TreePlan:
    """The plan of a tree of ``shape`` over a vocabulary of ``vocab`` tokens."""
    children = min(shape.top_k, vocab)
    added, fed = [children], []
    for _ in range(shape.depth - 1):
        fed.append(min(shape.top_k, added[-1]))
        added.append(fed[-1] * children)
    return TreePlan(tuple(added), tuple(fed), children)


class GrowingTree:
    """One step's tree, grown depth by depth in fixed-shape tensors on the drafter's device.

    Node i sits in slot i, numbered in creation order (parents first; a depth's nodes
    row-major over the frontier that spawned them), ``capacity`` slots in all:
    tokens: LongTensor[C]; parents: LongTensor[C], -1 for a root child; scores: FloatTensor[C],
    the float32 log-probability of the root-to-node path; logq: FloatTensor[C], the float32
    log-probability of the node's token after its parent (log q); ancestors: BoolTensor[C, C],
    [i, j] when node j is node i or one of its ancestors. ``size`` (nodes added so far) is a
    host integer that the plan decides, so growing never reads the device.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.logq = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.ancestors = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        self.size = 0

    def _add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, logq: torch.Tensor) -> slice:
        """Write ``tokens``, ``parents``, ``scores``, ``logq`` ([n] each) into the next n slots; their slots."""
        slots = slice(self.size, self.size + tokens.shape[0])
        self.tokens[slots], self.parents[slots], self.scores[slots], self.logq[slots] = tokens, parents, scores, logq
        self.ancestors[slots, slots].fill_diagonal_(True)
        self.size = slots.stop
        return slots

    def add_roots(self, logq: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Add the root's children (log q and tokens: [k] each); their node ids, LongTensor[k]."""
        parents = torch.full_like(tokens, -1)
        slots = self._add(tokens, parents, logq, logq)
        return torch.arange(slots.start, slots.stop, device=tokens.device)

    def add_children(self, frontier: torch.Tensor, logq: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Add ``tokens`` [F, k] as the children of the ``frontier`` nodes [F], row-major, with
        their log q [F, k]; returns their path scores, FloatTensor[F, k]."""
        totals = self.scores[frontier][:, None] + logq
        parents = frontier[:, None].expand_as(tokens).reshape(-1)
        slots = self._add(tokens.reshape(-1), parents, totals.reshape(-1), logq.reshape(-1))
        self.ancestors[slots] |= self.ancestors[parents]
        return totals

    def best(self, count: int) -> DraftedTree:
        """The ``count`` highest-scoring nodes, renumbered in creation order.

        A child's score never exceeds its parent's (log-probabilities are <= 0) and a stable
        sort keeps a parent before an equal-scoring child, so the kept set contains every
        kept node's ancestors.
        """
        scores = self.scores[: self.size]
        order = torch.sort(scores, descending=True, stable=True).indices[:count]
        kept = torch.sort(order).values
        renumber = torch.full((self.size,), -1, dtype=torch.long, device=scores.device)
        renumber[kept] = torch.arange(kept.shape[0], device=scores.device)
        parents = self.parents[kept]
        parents = torch.where(parents >= 0, renumber[parents.clamp(min=0)], parents)
        # q in float64 then rounded, as float32(math.exp(log q)) was before the tree moved to the device.
        probs = self.logq[kept].double().exp().float()
        return DraftedTree(self.tokens[kept], parents, scores[kept], probs)


@dataclass(frozen=True)
class DraftedTree:
    """The tree a drafter hands to the engine, on the drafter's device (N nodes, parents first).

    tokens: LongTensor[N]; parents: LongTensor[N] (-1 for a root child); scores: FloatTensor[N],
    path log-probabilities; probs: FloatTensor[N], q of each node's token after its parent.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor

    def to_draft(self, device: torch.device | str) -> Draft:
        """The engine's ``Draft``: tokens and probs on ``device``, parents and a copy of the
        tokens on the host, both brought there by the step's one host transfer."""
        host = torch.stack([self.tokens, self.parents]).cpu()
        return Draft(
            tokens=self.tokens.to(device), probs=self.probs.to(device), parents=host[1], host_tokens=host[0]
        )


@dataclass(frozen=True)
class Frontier:
    """The F nodes one drafter forward feeds at one depth, after the S tree nodes fed at
    earlier depths (in feed order); tensors on the tree's device.

    depth: the frontier's depth (every node shares it); nodes: LongTensor[F], node ids;
    tokens: LongTensor[F]; parent_rows: LongTensor[F], each node's parent's row in the
    previous depth's frontier (0, the root, at depth 0); allowed: BoolTensor[F, S + F], [r, s]
    when the node in tree cache slot s is frontier node r's ancestor or itself.
    tree: the whole tree being grown (read only).
    """

    depth: int
    nodes: torch.Tensor
    tokens: torch.Tensor
    parent_rows: torch.Tensor
    allowed: torch.Tensor
    tree: GrowingTree

    def attention(self, committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the frontier attends to after ``committed`` cached context positions and the tree
        nodes fed before (BoolTensor[F, committed + S + F]: the whole context, its ancestors and
        itself) and its position ids (LongTensor[F]: committed + depth), on the tree's device."""
        count, device = self.nodes.shape[0], self.nodes.device
        context = torch.ones(count, committed, dtype=torch.bool, device=device)
        positions = torch.full((count,), committed + self.depth, dtype=torch.long, device=device)
        return torch.cat([context, self.allowed], dim=1), positions


NextLogprobs = Callable[[Frontier], torch.Tensor]


def expand_tree(root_logprobs: torch.Tensor, next_logprobs: NextLogprobs, shape: TreeShape) -> DraftedTree:
    """Grow a tree the way EAGLE-2 does, then keep its best ``shape.nodes`` nodes; no host sync.

    root_logprobs: FloatTensor[V], the drafter's log-probabilities after the committed context.
    next_logprobs(frontier): FloatTensor[F, V], the drafter's log-probabilities after each
        frontier node; one drafter forward per call.
    Every expanded node adds its ``top_k`` most likely children to the tree; of the children
    added at one depth, the ``top_k`` with the highest path log-probability are expanded
    next. ``shape.depth - 1`` calls of ``next_logprobs`` in all (so ``shape.depth`` drafter
    forwards per step, as for a chain of that many drafts). EAGLE's ``depth`` setting counts levels after
    the first, so its depth 6 is depth 7 here. Sizes come from ``tree_plan``, values stay on the device.
    """
    plan = tree_plan(shape, root_logprobs.shape[-1])
    tree = GrowingTree(plan.capacity, root_logprobs.device)
    values, tokens = torch.topk(root_logprobs.float(), plan.children)
    frontier = tree.add_roots(values, tokens)
    parent_rows = torch.zeros_like(frontier)
    fed = frontier[:0]
    for depth in range(len(plan.fed)):
        fed = torch.cat([fed, frontier])
        allowed = tree.ancestors[frontier][:, fed]
        logprobs = next_logprobs(Frontier(depth, frontier, tree.tokens[frontier], parent_rows, allowed, tree)).float()
        child_values, child_tokens = torch.topk(logprobs, plan.children, dim=-1)
        start = tree.size
        totals = tree.add_children(frontier, child_values, child_tokens)
        if depth + 1 < len(plan.fed):  # the deepest children are never expanded
            best = torch.sort(torch.topk(totals.flatten(), plan.fed[depth + 1]).indices).values
            frontier, parent_rows = start + best, best // plan.children
    return tree.best(shape.nodes)
