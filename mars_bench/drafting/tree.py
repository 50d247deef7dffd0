"""Tree drafting: the tree's shape and EAGLE-2 style dynamic expansion, for one sequence or a batch.

Trees are given by ``parents`` as described in ``mars_bench/common/trees.py``. The trees of a
batch's B rows grow together, depth by depth, in fixed-shape tensors on the drafter's device
(``GrowingTrees``: a leading row axis, one drafter forward per depth for every row), their sizes
planned from the shape alone, so the expansion never waits for the device; the finished trees
reach the host in one transfer (``DraftedTrees.to_drafts``). One sequence's tree is the batch of
one (``expand_tree``: 1-D views of the same tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def step_shapes(limits: Sequence[int], top_k: int, tree_tokens: int) -> tuple[TreeShape, list[int]]:
    """The shape every row's tree grows to in a step (the deepest row's) and each row's own depth
    (``TreeShape.for_step``; 1 for a row with no drafts to make, whose tree is dropped)."""
    depths = [TreeShape.for_step(max(limit, 1), top_k, tree_tokens).depth for limit in limits]
    return TreeShape(max(depths), top_k, tree_tokens), depths


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


class GrowingTrees:
    """One step's trees for B rows, grown depth by depth in lockstep, in fixed-shape tensors on the
    drafter's device.

    Node i of row b sits in slot [b, i], numbered in creation order (parents first; a depth's nodes
    row-major over the frontier that spawned them), ``capacity`` slots per row:
    tokens: LongTensor[B, C]; parents: LongTensor[B, C], -1 for a root child; scores: FloatTensor[B, C],
    the float32 log-probability of the root-to-node path; logq: FloatTensor[B, C], the float32
    log-probability of the node's token after its parent (log q); ancestors: BoolTensor[B, C, C],
    [b, i, j] when node j is node i or one of its ancestors. ``size`` (nodes added per row so far) is
    a host integer that the plan decides, so growing never reads the device.
    """

    def __init__(self, rows: int, capacity: int, device: torch.device) -> None:
        self.tokens = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        self.parents = torch.full((rows, capacity), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        self.logq = torch.zeros(rows, capacity, dtype=torch.float32, device=device)
        self.ancestors = torch.zeros(rows, capacity, capacity, dtype=torch.bool, device=device)
        self.size = 0

    def row(self, index: int) -> GrowingTree:
        return GrowingTree(self, index)

    def _add(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, logq: torch.Tensor) -> slice:
        """Write ``tokens``, ``parents``, ``scores``, ``logq`` ([B, n] each) into the next n slots; their slots."""
        slots = slice(self.size, self.size + tokens.shape[1])
        self.tokens[:, slots], self.parents[:, slots], self.scores[:, slots], self.logq[:, slots] = tokens, parents, scores, logq
        self.ancestors[:, slots, slots].diagonal(dim1=1, dim2=2).fill_(True)
        self.size = slots.stop
        return slots

    def add_roots(self, logq: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Add the roots' children (log q and tokens: [B, k] each); their node ids, LongTensor[B, k]."""
        slots = self._add(tokens, torch.full_like(tokens, -1), logq, logq)
        return torch.arange(slots.start, slots.stop, device=tokens.device).expand_as(tokens)

    def add_children(self, frontier: torch.Tensor, logq: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Add ``tokens`` [B, F, k] as the children of the ``frontier`` nodes [B, F], row-major, with
        their log q [B, F, k]; returns their path scores, FloatTensor[B, F, k]."""
        rows = tokens.shape[0]
        totals = self.scores.gather(1, frontier)[:, :, None] + logq
        parents = frontier[:, :, None].expand_as(tokens).reshape(rows, -1)
        slots = self._add(tokens.reshape(rows, -1), parents, totals.reshape(rows, -1), logq.reshape(rows, -1))
        self.ancestors[:, slots] |= self.ancestors.gather(1, parents[:, :, None].expand(-1, -1, self.ancestors.shape[-1]))
        return totals

    def best(self, count: int, sizes: Sequence[int]) -> DraftedTrees:
        """Per row b, the ``count`` highest-scoring of its first ``sizes[b]`` nodes (all of them if fewer),
        renumbered in creation order.

        A child's score never exceeds its parent's (log-probabilities are <= 0) and a stable sort keeps
        a parent before an equal-scoring child, so a row's kept set contains every kept node's
        ancestors. A row's first nodes are its shallowest, so ``sizes`` cuts a row to its own depth.
        """
        rows, size, device = self.scores.shape[0], self.size, self.scores.device
        scores = self.scores[:, :size]
        if min(sizes) < size:  # nodes past a row's own depth sort last (stably, after any real -inf)
            scores = scores.masked_fill(torch.arange(size, device=device) >= torch.tensor(sizes, device=device)[:, None],
                                        float("-inf"))  # fmt: skip
        counts = tuple(min(count, limit) for limit in sizes)
        width = max(counts)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
        if min(counts) < width:  # a row's columns past its count point at slot ``size``, after every node
            order = order.masked_fill(torch.arange(width, device=device) >= torch.tensor(counts, device=device)[:, None], size)
        kept = torch.sort(order, dim=-1).values
        renumber = torch.full((rows, size + 1), -1, dtype=torch.long, device=device)
        renumber.scatter_(1, kept, torch.arange(width, device=device).expand(rows, -1))
        kept = kept.clamp(max=size - 1)
        parents = self.parents.gather(1, kept)
        parents = torch.where(parents >= 0, renumber.gather(1, parents.clamp(min=0)), parents)
        # q in float64 then rounded, as float32(math.exp(log q)) was before the tree moved to the device.
        probs = self.logq.gather(1, kept).double().exp().float()
        return DraftedTrees(self.tokens.gather(1, kept), parents, self.scores.gather(1, kept), probs, counts)


class GrowingTree:
    """One row of ``GrowingTrees``: 1-D views of its tensors (tokens, parents, scores, logq [C];
    ancestors [C, C]) that follow the growth, and ``size``."""

    def __init__(self, trees: GrowingTrees, row: int) -> None:
        self.trees = trees
        self.tokens, self.parents = trees.tokens[row], trees.parents[row]
        self.scores, self.logq, self.ancestors = trees.scores[row], trees.logq[row], trees.ancestors[row]

    @property
    def size(self) -> int:
        return self.trees.size


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
class DraftedTrees:
    """The trees of B rows (``DraftedTree`` per row, right-padded to N nodes): tokens, parents, scores,
    probs [B, N] on the drafter's device; counts: N_b per row (a row's columns past it are padding)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    counts: tuple[int, ...]

    def row(self, index: int) -> DraftedTree:
        nodes = slice(0, self.counts[index])
        return DraftedTree(self.tokens[index, nodes], self.parents[index, nodes], self.scores[index, nodes],
                           self.probs[index, nodes])  # fmt: skip

    def to_drafts(self, device: torch.device | str, wanted: Sequence[bool]) -> list[Draft | None]:
        """A ``Draft`` per row (None where not ``wanted``), as ``DraftedTree.to_draft`` gives it, every
        row's parents and tokens brought to the host in one transfer."""
        host = torch.stack([self.tokens, self.parents]).cpu()
        tokens, probs = self.tokens.to(device), self.probs.to(device)
        return [Draft(tokens=tokens[row, :count], probs=probs[row, :count], parents=host[1, row, :count],
                      host_tokens=host[0, row, :count]) if want else None
                for row, (count, want) in enumerate(zip(self.counts, wanted))]  # fmt: skip


@dataclass(frozen=True)
class Frontier:
    """The F nodes one drafter forward feeds at one depth of one sequence's tree, after the S tree nodes
    fed at earlier depths (in feed order); tensors on the tree's device.

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


@dataclass(frozen=True)
class Frontiers:
    """Every row's frontier at one depth (``Frontier`` with a leading row axis B): nodes, tokens,
    parent_rows [B, F]; allowed [B, F, S + F]; trees: the trees being grown (read only)."""

    depth: int
    nodes: torch.Tensor
    tokens: torch.Tensor
    parent_rows: torch.Tensor
    allowed: torch.Tensor
    trees: GrowingTrees

    def row(self, index: int) -> Frontier:
        return Frontier(self.depth, self.nodes[index], self.tokens[index], self.parent_rows[index], self.allowed[index],
                        self.trees.row(index))  # fmt: skip

    def attention(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What each row's frontier attends to after its cached context (``context`` BoolTensor[B, S_c], the
        positions each row attends to) and the tree nodes fed before (BoolTensor[B, F, S_c + S + F]), and
        its position ids (LongTensor[B, F]: the row's attended positions + depth)."""
        count = self.nodes.shape[1]
        positions = context.long().sum(dim=1, keepdim=True).expand(-1, count) + self.depth
        return torch.cat([context[:, None, :].expand(-1, count, -1), self.allowed], dim=2), positions


NextLogprobs = Callable[[Frontier], torch.Tensor]
BatchNextLogprobs = Callable[[Frontiers], torch.Tensor]


def expand_trees(
    root_logprobs: torch.Tensor, next_logprobs: BatchNextLogprobs, shape: TreeShape, depths: Sequence[int] | None = None
) -> DraftedTrees:
    """Grow B trees the way EAGLE-2 does, then keep each row's best ``shape.nodes`` nodes; no host sync.

    root_logprobs: FloatTensor[B, V], the drafter's log-probabilities after each row's committed context.
    next_logprobs(frontiers): FloatTensor[B, F, V], the drafter's log-probabilities after each frontier
        node of each row; one drafter forward per call.
    depths: each row's own depth (at most ``shape.depth``, the depth every row grows to; default: that).
    Every expanded node adds its ``top_k`` most likely children to the tree; of the children added at
    one depth, the ``top_k`` with the highest path log-probability are expanded next. ``shape.depth - 1``
    calls of ``next_logprobs`` in all (so ``shape.depth`` drafter forwards per step, as for a chain of
    that many drafts). A depth's nodes depend on the depths before only, so a row cut to its own depth
    keeps the tree it grows alone. EAGLE's ``depth`` setting counts levels after the first, so its depth
    6 is depth 7 here. Sizes come from ``tree_plan``, values stay on the device.
    """
    plan = tree_plan(shape, root_logprobs.shape[-1])
    rows = root_logprobs.shape[0]
    trees = GrowingTrees(rows, plan.capacity, root_logprobs.device)
    values, tokens = torch.topk(root_logprobs.float(), plan.children, dim=-1)
    frontier = trees.add_roots(values, tokens)
    parent_rows = torch.zeros_like(frontier)
    fed = frontier[:, :0]
    for depth in range(len(plan.fed)):
        fed = torch.cat([fed, frontier], dim=1)
        ancestors = trees.ancestors.gather(1, frontier[:, :, None].expand(-1, -1, plan.capacity))
        allowed = ancestors.gather(2, fed[:, None, :].expand(-1, frontier.shape[1], -1))
        frontiers = Frontiers(depth, frontier, trees.tokens.gather(1, frontier), parent_rows, allowed, trees)
        child_values, child_tokens = torch.topk(next_logprobs(frontiers).float(), plan.children, dim=-1)
        start = trees.size
        totals = trees.add_children(frontier, child_values, child_tokens)
        if depth + 1 < len(plan.fed):  # the deepest children are never expanded
            best = torch.sort(torch.topk(totals.reshape(rows, -1), plan.fed[depth + 1], dim=-1).indices, dim=-1).values
            frontier, parent_rows = start + best, best // plan.children
    sizes = [sum(plan.added[:depth]) for depth in (depths or [shape.depth] * rows)]
    return trees.best(shape.nodes, sizes)


def expand_tree(root_logprobs: torch.Tensor, next_logprobs: NextLogprobs, shape: TreeShape) -> DraftedTree:
    """``expand_trees`` for one sequence: root_logprobs FloatTensor[V]; next_logprobs(frontier) gives
    FloatTensor[F, V] for a ``Frontier``; the tree of ``shape.depth``."""
    trees = expand_trees(root_logprobs[None], lambda frontiers: next_logprobs(frontiers.row(0))[None], shape)
    return trees.row(0)
