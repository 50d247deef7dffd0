"""Batched tensor pieces shared by the verifiers (no Python loop per token or per node).

Row r of ``target_logits`` judges the children of row r's token: the root's children are
judged by row 0, node i's children by row i + 1 (``TreeLayout.parent_rows``).

Every verifier computes, for all N drafted nodes at once, whether the node would be
accepted if the walk reached it, and why, and for every row which token to emit if the
walk stops there. ``finish`` then walks the tree: from each accepted node the walk takes
the first accepted child (in draft order, or in the verifier's order of preference) and
stops where no child is accepted. The result goes to the host in one transfer. A chain is
the tree with one child per node, for which the walk is the longest accepted prefix.

A step may hold B requests (``VerifyInput.drafts_per_row``): their drafts and target-logits
rows one after another, judged together as a forest (``TreeLayout``). Every per-node and
per-row computation is the same for a forest; shapes written [N+1, ...] below have N + B rows
then. Each request draws its random numbers from its own stream (``sampling.RandomStreams``).

Siblings are tried one after another, so a sampling verifier's test of a sibling assumes
the earlier siblings were rejected; ``sibling_normalisers`` gives the probability mass left
after those rejections. Siblings must carry distinct tokens (every tree drafter proposes
the top-k of a distribution).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from mars_bench.common.trees import depths_of
from mars_bench.verification.base import Decisions, Reason, Verdict, VerifyInput
from mars_bench.verification.sampling import RandomStreams, SamplingParams, probabilities


@dataclass(frozen=True)
class TopTwo:
    """The two largest processed logits per row ([R] each); see ``top_two``."""

    z1: torch.Tensor
    t1: torch.Tensor
    z2: torch.Tensor
    t2: torch.Tensor

    def at(self, rows: torch.Tensor) -> TopTwo:
        return TopTwo(self.z1[rows], self.t1[rows], self.z2[rows], self.t2[rows])


@dataclass(frozen=True)
class TreeLayout:
    """The shape of one step's drafts, for one request or a batch of B; tensors on the device.

    A batch is a forest: request b's N_b nodes follow request b - 1's, and its N_b + 1
    target-logits rows (its root's, then one per node) follow too. Node and row indices here are
    the batch's (global); a request's own are these less its ``node_starts`` / ``root_rows`` entry.

    parent_rows: LongTensor[N], the target-logits row that judges each node.
    node_rows: LongTensor[N], each node's own row (the one judging its children).
    node_request: LongTensor[N], the request of each node; node_start: LongTensor[N], the index of
        its request's first node.
    root_row_tensor: LongTensor[B], each request's root row.
    depth_tensor: LongTensor[N], ``depths`` on the device.
    depth_waves: per depth d >= 1, (nodes at depth d, their parents), device LongTensors (empty
        for chains, whose walk is a prefix).
    sibling_waves: per sibling rank r >= 1, (nodes of rank r, their previous siblings), as
        device LongTensors.
    judging_rows: LongTensor, the rows that have children (ascending).
    depths: depth per node (0 for a root's children).
    has_children: per row (each request's root's, then each node's).
    chain: whether every request's nodes form a chain.
    drafts_per_row: N_b per request; node_starts, root_rows: each request's first node and root row.
    """

    parent_rows: torch.Tensor
    node_rows: torch.Tensor
    node_request: torch.Tensor
    node_start: torch.Tensor
    root_row_tensor: torch.Tensor
    depth_tensor: torch.Tensor
    depth_waves: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    sibling_waves: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    judging_rows: torch.Tensor
    depths: tuple[int, ...]
    has_children: tuple[bool, ...]
    chain: bool
    drafts_per_row: tuple[int, ...]
    node_starts: tuple[int, ...]
    root_rows: tuple[int, ...]

    @property
    def row_count(self) -> int:
        """Target-logits rows of the step: N + B."""
        return len(self.has_children)

    @property
    def rows_per_request(self) -> tuple[int, ...]:
        return tuple(count + 1 for count in self.drafts_per_row)

    def drafted_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """``per_row`` ([N+B, ...]) at the row judging each node of a chain layout ([N, ...]): a view
        for one request (rows 0..N-1), a gather for a batch."""
        if len(self.drafts_per_row) == 1:
            return per_row[: self.parent_rows.shape[0]]
        return per_row[self.parent_rows]

    def with_drafted_rows(self, per_row: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """``per_row`` ([N+B, ...]) with the rows judging a chain's nodes replaced by ``drafted`` ([N, ...])."""
        if len(self.drafts_per_row) == 1:
            return torch.cat([drafted, per_row[drafted.shape[0] :]])
        return per_row.index_copy(0, self.parent_rows, drafted)

    def on_path(self, chosen: torch.Tensor) -> torch.Tensor:
        """BoolTensor[N]: the nodes whose every ancestor, and themselves, are ``chosen`` ([N]):
        the accepted path of each request. A chain's is the prefix before its first unchosen node."""
        if self.chain:
            rejected = (~chosen).long().cumsum(0)
            before = torch.cat([rejected.new_zeros(1), rejected])[self.node_start]  # rejected before the request
            return rejected == before
        on_path = chosen.clone()
        for nodes, parents in self.depth_waves:
            on_path[nodes] &= on_path[parents]
        return on_path

    def stop_rows(self, on_path: torch.Tensor) -> torch.Tensor:
        """LongTensor[B]: the row after each request's accepted path: its deepest accepted node's
        row, or its root row when nothing is accepted. Parents come before their children, so the
        deepest node on a path is its last."""
        last = torch.where(on_path, self.node_rows, -1)
        return self.root_row_tensor.scatter_reduce(0, self.node_request, last, reduce="amax", include_self=True)


@lru_cache(maxsize=256)
def tree_layout(parents: tuple[int, ...], device: str, drafts_per_row: tuple[int, ...] | None = None) -> TreeLayout:
    """The layout of ``parents`` (cached: a chain's costs nothing after its first step).

    parents: each node's parent within its own request (-1 for a child of its root), the requests'
    nodes one after another; drafts_per_row: N_b per request (None: one request). Its index tensors
    reach ``device`` in one host-to-device copy (each copy syncs a GPU).
    """
    counts = drafts_per_row or (len(parents),)
    global_parents, rows, node_rows, requests, starts, depths = [], [], [], [], [], []
    node_starts, root_rows, chain, start = [], [], True, 0
    for request, count in enumerate(counts):
        local = parents[start : start + count]
        depths += depths_of(local).tolist()  # validates the order
        chain = chain and local == tuple(range(-1, count - 1))
        root = start + request
        node_starts.append(start)
        root_rows.append(root)
        global_parents += [start + parent if parent >= 0 else -1 for parent in local]
        rows += [root + parent + 1 for parent in local]
        node_rows += range(root + 1, root + count + 1)
        requests += [request] * count
        starts += [start] * count
        start += count
    waves: list[list[tuple[int, int]]] = []  # per rank >= 1: (node, previous sibling)
    last_child: dict[int, tuple[int, int]] = {}  # row -> (last child, its rank)
    for node, row in enumerate(rows):
        if row in last_child:
            previous, rank = last_child[row]
            waves += [[] for _ in range(rank + 1 - len(waves))]
            waves[rank].append((node, previous))
            last_child[row] = (node, rank + 1)
        else:
            last_child[row] = (node, 0)
    levels: list[list[tuple[int, int]]] = [[] for _ in range(0 if chain else max(depths, default=0))]
    for node, depth in enumerate(depths):
        if depth and not chain:
            levels[depth - 1].append((node, global_parents[node]))
    parts = [rows, node_rows, requests, starts, root_rows, depths, sorted(last_child)]
    parts += [[n for wave in waves for n, _ in wave], [p for wave in waves for _, p in wave]]
    parts += [[n for level in levels for n, _ in level], [p for level in levels for _, p in level]]
    packed = torch.tensor([value for part in parts for value in part], dtype=torch.long).to(device)
    row_tensor, node_row_tensor, request_tensor, start_tensor, root_tensor, depth_tensor, judging, *rest = packed.split(
        [len(part) for part in parts]
    )
    wave_nodes, wave_before, level_nodes, level_parents = rest
    wave_sizes, level_sizes = [len(wave) for wave in waves], [len(level) for level in levels]
    return TreeLayout(
        parent_rows=row_tensor,
        node_rows=node_row_tensor,
        node_request=request_tensor,
        node_start=start_tensor,
        root_row_tensor=root_tensor,
        depth_tensor=depth_tensor,
        depth_waves=tuple(zip(level_nodes.split(level_sizes), level_parents.split(level_sizes))),
        sibling_waves=tuple(zip(wave_nodes.split(wave_sizes), wave_before.split(wave_sizes))),
        judging_rows=judging,
        depths=tuple(depths),
        has_children=tuple(row in last_child for row in range(len(parents) + len(counts))),
        chain=chain,
        drafts_per_row=tuple(counts),
        node_starts=tuple(node_starts),
        root_rows=tuple(root_rows),
    )


PROBLEMS = (
    "target_logits contain NaN",
    "target_logits contain +inf",
    "a target_logits row has no finite entry",
    "a draft token is outside the vocabulary",
    "draft_probs are not probabilities in [0, 1]",
    "draft_dists are not non-negative distributions",
    "two siblings carry the same token",
)


def input_problems(step: VerifyInput, layout: TreeLayout, row_max: torch.Tensor) -> torch.Tensor:
    """BoolTensor[len(PROBLEMS)] on the device: which input checks fail (no host sync).

    The three logits checks read one row maximum (``row_max``: the raw logits' [N+1],
    ``TargetView.raw_max``): max propagates NaN, is +inf where any entry is, and is -inf only
    where no entry is finite.
    """
    logits, drafts = step.target_logits, step.draft_tokens
    none = torch.zeros((), dtype=torch.bool, device=logits.device)
    flags = [
        torch.isnan(row_max).any(),
        torch.isposinf(row_max).any(),
        torch.isneginf(row_max).any(),
        ((drafts < 0) | (drafts >= logits.shape[-1])).any() if drafts.numel() else none,
        none if step.draft_probs is None else ~((step.draft_probs >= 0) & (step.draft_probs <= 1 + 1e-4)).all(),
        none if step.draft_dists is None or not step.draft_dists.numel() else ~(step.draft_dists.min() >= 0),
        none if layout.chain else repeated_siblings(drafts, layout),
    ]
    return torch.stack([flag.to(logits.device) for flag in flags])


def repeated_siblings(drafts: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """BoolTensor[]: whether two children of one row carry the same token (sorted by row, then
    token: a repeat sits next to its twin; no [N, N] comparison, so a batch's forest stays linear)."""
    if drafts.shape[0] < 2:
        return torch.zeros((), dtype=torch.bool, device=drafts.device)
    by_token = drafts.argsort(stable=True)
    order = by_token[layout.parent_rows[by_token].argsort(stable=True)]
    rows, tokens = layout.parent_rows[order], drafts[order]
    return ((rows[1:] == rows[:-1]) & (tokens[1:] == tokens[:-1])).any()


class TargetView:
    """One step's target logits as a verifier processes them: processed logits [N+1, V], their
    top-2 per row, the raw logits' row maximum and, computed on first use, the probabilities
    p [N+1, V] (``sampling.probabilities``).

    ``target_view`` hands the same view to every verifier that processes the same logits tensor
    the same way, so a step judged by a live verifier, its shadows and their emission
    distributions processes and normalises its logits once.
    """

    def __init__(self, logits: torch.Tensor, processed: torch.Tensor, sampling: SamplingParams) -> None:
        self.processed, self.sampling = processed, sampling
        self.rows = top_two(processed)
        self.raw_max = logits.max(dim=-1).values  # [N+1], for the input checks
        self._probs: torch.Tensor | None = None

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = probabilities(self.processed, self.sampling)
        return self._probs


_VIEWS: dict[object, tuple[torch.Tensor, int, SamplingParams, TargetView]] = {}  # processing -> the last view


def target_view(logits: torch.Tensor, sampling: SamplingParams, process: Callable, key: object) -> TargetView:
    """The view of ``logits`` under ``process(logits, sampling)``; ``key`` names the processing.

    A one-slot cache per processing: a hit needs the very same tensor, unchanged since (its
    version counter; an inference-mode tensor has none, and verifiers never write to their
    inputs), and the same sampling settings.
    """
    version = version_of(logits)
    cached = _VIEWS.get(key)
    if cached is not None and cached[0] is logits and cached[1] == version and cached[2] == sampling:
        return cached[3]
    view = TargetView(logits, process(logits, sampling), sampling)
    _VIEWS[key] = (logits, version, sampling, view)
    return view


def version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write); -1 for an inference-mode tensor."""
    try:
        return tensor._version
    except RuntimeError:  # inference tensors do not track a version
        return -1


def raise_on_problems(flags: list) -> None:
    """ValueError, in one line naming every failed check, where a flag of ``input_problems`` is set."""
    failed = [problem for problem, flag in zip(PROBLEMS, flags) if flag]
    if failed:
        raise ValueError("invalid verifier input: " + "; ".join(failed))


@dataclass(frozen=True)
class Prepared:
    """What every verifier starts from: processed logits [N+1, V], the top-2 of every row
    (``rows``) and of the row judging each node (``nodes``), the layout, the input checks
    still on the device, and the target's probabilities (``probs``, computed once per view)."""

    processed: torch.Tensor
    rows: TopTwo
    nodes: TopTwo
    layout: TreeLayout
    problems: torch.Tensor
    view: TargetView
    drafts: torch.Tensor | None = None  # LongTensor[N]: the draft tokens, reported on the accepted path by ``finish``

    @property
    def probs(self) -> torch.Tensor:
        """FloatTensor[N+1, V]: the processed target probabilities p (one-hot at the argmax when greedy)."""
        return self.view.probs

    def parent_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """``per_row`` ([N+1, ...]) at the row judging each node ([N, ...])."""
        return per_row[self.layout.parent_rows]


def top_two(processed: torch.Tensor) -> TopTwo:
    """Top-2 of processed logits [R, V]: the one definition of the target's top token.

    t1 is the first index of the row maximum, ``torch.argmax``'s choice, which greedy
    decoding without drafts also emits; t2 is the first index of the maximum over the rest
    of the row (t2 == t1, z2 == -inf when V == 1). ``torch.topk`` orders ties arbitrarily, so
    with it a greedy verifier could reject a draft equal to the argmax and then emit it.
    """
    t1 = processed.argmax(dim=-1)
    z1 = gather_at(processed, t1)
    rest = processed.scatter(-1, t1[:, None], float("-inf"))
    t2 = rest.argmax(dim=-1)
    return TopTwo(z1, t1, gather_at(rest, t2), t2)


def gather_at(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """rows[i, tokens[i]] for rows [N, V] and tokens [N]."""
    return rows.gather(-1, tokens[:, None]).squeeze(-1)


def at_nodes(per_row: torch.Tensor, tokens: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """FloatTensor[N]: ``per_row`` ([N+1, V]) at each node's token in the row judging it."""
    return per_row[layout.parent_rows, tokens]


def sibling_normalisers(p_node: torch.Tensor, q_node: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """FloatTensor[N]: the probability mass left at each node's row once every earlier
    sibling was rejected, when a rejection of token x with draft probability q lowers p(x) to
    max(0, p(x) - q * mass) (the strict rule with a one-hot q: q = 1 removes p(x) entirely).

    p_node: p(token) at the row judging each node; q_node: each node's q ([N] each).
    One small step per sibling rank (at most top-k, no host sync), none for a chain.
    """
    mass = torch.ones_like(p_node)
    for nodes, before in layout.sibling_waves:
        mass[nodes] = mass[before] - torch.minimum(p_node[before], q_node[before] * mass[before])
    return mass.clamp(min=0.0)


def residual_rows(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_dists: torch.Tensor | None, layout: TreeLayout
) -> torch.Tensor:
    """Unnormalised correction distribution per row ([N+1, V]): p with every child's draft
    removed as the strict rule removes it; p itself at a row with no children, and where
    nothing is left.

    ``draft_dists`` None means deterministic proposals (q one-hot at each draft): the
    children's tokens get probability 0. With ``draft_dists`` (chains only) a row's residual
    is max(0, p - q).
    """
    if draft_dists is None:
        residual = target_probs.index_put((layout.parent_rows, draft_tokens), torch.zeros((), device=target_probs.device))
    else:
        residual = layout.with_drafted_rows(target_probs, (layout.drafted_rows(target_probs) - draft_dists).clamp_(min=0.0))
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


@dataclass(frozen=True)
class RowDraws:
    """The token to emit at a stop row, drawn only once the stop row is known.

    weights: FloatTensor[N+B, V], a non-negative (unnormalised) distribution per row. Only
    the stop rows are sampled: drawing every row would cost N+B cumulative sums over the
    vocabulary for B tokens. streams: each request's random numbers.
    """

    weights: torch.Tensor
    streams: RandomStreams

    def at(self, rows: torch.Tensor) -> torch.Tensor:
        """LongTensor[B]: a sample from each request's stop row (``rows``: LongTensor[B], on the device),
        with one uniform from the request's own stream."""
        return self.streams.sample(self.weights.index_select(0, rows), (1,) * rows.shape[0])


Candidates = torch.Tensor | RowDraws  # LongTensor[N+1] (a token per row) or draws per row


@dataclass(frozen=True)
class StrictOutcome:
    """The Leviathan / Chen rule per node: accepted[N] and the correction to draw at each stop row."""

    accepted: torch.Tensor
    candidates: RowDraws


def strict_rejection(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_dists: torch.Tensor | None,
    layout: TreeLayout,
    streams: RandomStreams,
) -> StrictOutcome:
    """Accept a draft x with probability min(1, p(x) / q(x)); on reject sample from the residual.

    target_probs: [N+1, V] processed target probabilities. A chain's rows use max(0, p - q)
    with the drafter's ``draft_dists`` when given. Tree drafts are deterministic (q one-hot),
    the multi-draft rule of SpecInfer: a sibling is tried on p renormalised without the
    earlier siblings' tokens, and after every child is rejected the correction is sampled
    from p without them. Randomness drawn: N uniforms, then (in ``finish``) one uniform for
    each stop row (each request's from its own stream).
    """
    p_draft = at_nodes(target_probs, draft_tokens, layout)
    if draft_dists is None:
        mass = sibling_normalisers(p_draft, torch.ones_like(p_draft), layout)
        p_draft, q_draft = p_draft / mass.clamp(min=torch.finfo(mass.dtype).tiny), torch.ones_like(p_draft)
    else:
        q_draft = gather_at(draft_dists, draft_tokens)
    uniforms = streams.node_uniforms(target_probs.device)
    accepted = uniforms * q_draft < p_draft
    return StrictOutcome(accepted, RowDraws(residual_rows(target_probs, draft_tokens, draft_dists, layout), streams))


def first_choices(accepted: torch.Tensor, layout: TreeLayout, preferred: torch.Tensor | None = None) -> torch.Tensor:
    """BoolTensor[N]: the accepted node each row's walk takes: the first accepted sibling in
    draft order, or the first among the ``preferred`` accepted siblings when there are any."""
    count = accepted.shape[0]
    order = torch.arange(count, device=accepted.device)
    rank = order if preferred is None else order + count * (~preferred).long()
    unranked = torch.full((layout.row_count,), 2 * count + 1, dtype=torch.long, device=accepted.device)
    best = unranked.scatter_reduce(0, layout.parent_rows, torch.where(accepted, rank, unranked[0]), reduce="amin")
    return accepted & (rank == best[layout.parent_rows])  # ranks are distinct: one winner per row


def finish(
    accepted: torch.Tensor,
    reasons: torch.Tensor,
    candidates: Candidates,
    prep: Prepared,
    preferred: torch.Tensor | None = None,
    statistics: dict[str, torch.Tensor] | None = None,
) -> list[Verdict]:
    """Walk each request's tree, emit its stop row's candidate, and report the decisions, with one
    host transfer for the whole batch. Returns a Verdict per request, in the request's own indices.

    accepted: BoolTensor[N], whether each node is accepted if reached; reasons: LongTensor[N]
    (the reason if reached); candidates: the token to emit per stop row (LongTensor[N+1]),
    or ``RowDraws`` to sample it from;
    preferred: BoolTensor[N] or None, nodes taken before their other accepted siblings;
    statistics: the verifier's declared statistics per row ([N+1] each: bool for a count, float for a value;
    ``on_rows`` spreads a chain's per-node ones), reported as ``Decisions.statistics`` at the visited depths.
    They travel in the same transfer. Raises ValueError, after the transfer, if an input check failed.
    """
    layout = prep.layout
    statistics = statistics or {}
    chosen = accepted if layout.chain else first_choices(accepted, layout, preferred)
    on_path = layout.on_path(chosen)
    stop_rows = layout.stop_rows(on_path)
    emitted = candidates.at(stop_rows) if isinstance(candidates, RowDraws) else candidates.gather(0, stop_rows)
    parts = [emitted, on_path, reasons, prep.problems, *statistics.values()]
    optional = [prep.drafts] if prep.drafts is not None else []
    packed = torch.cat([part.double() for part in parts + optional]).cpu()
    emitted, on_path, reasons, problems, *rest = packed.split([part.numel() for part in parts + optional])
    raise_on_problems(problems.tolist())
    tokens, on_path_list, reason_list = emitted.long().tolist(), on_path.bool().tolist(), reasons.long().tolist()
    per_row = {name: values.bool() if statistics[name].dtype == torch.bool else values.float()
               for name, values in zip(statistics, rest)}  # fmt: skip
    drafts = rest[len(statistics)].long().tolist() if prep.drafts is not None else None
    verdicts = []
    for request, (start, count, root) in enumerate(zip(layout.node_starts, layout.drafts_per_row, layout.root_rows)):
        path = sorted((node for node in range(start, start + count) if on_path_list[node]), key=layout.depths.__getitem__)
        stop = path[-1] + request + 1 if path else root
        visited_nodes = path + ([-1] if layout.has_children[stop] else [])  # -1: the rejected depth
        rows = torch.tensor(([root] + [node + request + 1 for node in path])[: len(visited_nodes)], dtype=torch.long)
        visited_reasons = [reason_list[node] if node >= 0 else int(Reason.REJECTED) for node in visited_nodes]
        decisions = Decisions(reasons=torch.tensor(visited_reasons, dtype=torch.long),
                              statistics={name: values[rows] for name, values in per_row.items()})  # fmt: skip
        accepted_path = torch.tensor([node - start for node in path], dtype=torch.long)
        path_tokens = None if drafts is None else [drafts[node] for node in path]
        verdicts.append(Verdict(accepted=accepted_path, next_token=tokens[request], decisions=decisions, path_tokens=path_tokens))
    return verdicts


def on_rows(per_node: torch.Tensor, layout: TreeLayout) -> torch.Tensor:
    """A chain's per-node statistic ([N]) at the row judging each node ([N+B]); the rows that judge no
    node (each request's last) hold False for a count, NaN for a value (no visited depth reads them)."""
    fill = False if per_node.dtype == torch.bool else float("nan")
    rows = torch.full((layout.row_count,), fill, dtype=per_node.dtype, device=per_node.device)
    return layout.with_drafted_rows(rows, per_node)


def reasons_from(accepted: torch.Tensor, accept_reason: torch.Tensor | Reason) -> torch.Tensor:
    """Reason per node: ``accept_reason`` where accepted, REJECTED elsewhere."""
    rejected = torch.full(accepted.shape, int(Reason.REJECTED), dtype=torch.long, device=accepted.device)
    if isinstance(accept_reason, Reason):
        accept_reason = torch.full_like(rejected, int(accept_reason))
    return torch.where(accepted, accept_reason, rejected)
