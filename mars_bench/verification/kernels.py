"""Batched tensor pieces shared by the verifiers (no Python loop per token or per node).

Row r of ``target_logits`` judges the children of row r's token: the root's children are
judged by row 0, node i's children by row i + 1 (``TreeLayout.parent_rows``).

Every verifier computes, for all N drafted nodes at once, whether the node would be
accepted if the walk reached it, and why, and for every row which token to emit if the
walk stops there. ``finish`` then walks the tree: from each accepted node the walk takes
the first accepted child (in draft order, or in the verifier's order of preference) and
stops where no child is accepted. The result goes to the host in one transfer. A chain is
the tree with one child per node, for which the walk is the longest accepted prefix.

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

from mars_bench.trees import ancestor_matrix, is_chain, node_depths
from mars_bench.verification.base import Decisions, Reason, Verdict, VerifyInput
from mars_bench.verification.sampling import SamplingParams, probabilities, sample_rows


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
    """The shape of one step's N drafts; tensors on the verification device.

    parent_rows: LongTensor[N], the target-logits row that judges each node.
    ancestors: BoolTensor[N, N], [i, j] when node j is node i or one of its ancestors.
    siblings: BoolTensor[N, N], [i, j] when nodes i and j share a parent (i == j included).
    depth_tensor: LongTensor[N], ``depths`` on the device.
    sibling_waves: per sibling rank r >= 1, (nodes of rank r, their previous siblings), as
        device LongTensors.
    judging_rows: LongTensor, the rows that have children (ascending).
    depths: depth per node (0 for the root's children).
    has_children: per row (the root's, then each node's).
    chain: whether the nodes form a chain.
    """

    parent_rows: torch.Tensor
    ancestors: torch.Tensor
    siblings: torch.Tensor
    depth_tensor: torch.Tensor
    sibling_waves: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    judging_rows: torch.Tensor
    depths: tuple[int, ...]
    has_children: tuple[bool, ...]
    chain: bool


@lru_cache(maxsize=256)
def tree_layout(parents: tuple[int, ...], device: str) -> TreeLayout:
    """The layout of ``parents`` (cached: a chain's costs nothing after its first step).

    Its index tensors reach ``device`` in one host-to-device copy (each copy syncs a GPU), and
    ``siblings`` is computed there.
    """
    parent_tensor = torch.tensor(parents, dtype=torch.long)
    rows = [parent + 1 for parent in parents]
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
    depths = node_depths(parent_tensor)
    parts = [rows, depths.tolist(), sorted(last_child)] + [[n for wave in waves for n, _ in wave]]
    parts += [[p for wave in waves for _, p in wave], ancestor_matrix(parent_tensor).flatten().tolist()]
    packed = torch.tensor([value for part in parts for value in part], dtype=torch.long).to(device)
    row_tensor, depth_tensor, judging, wave_nodes, wave_before, ancestors = packed.split([len(part) for part in parts])
    wave_sizes = [len(wave) for wave in waves]
    return TreeLayout(
        parent_rows=row_tensor,
        ancestors=ancestors.view(len(parents), len(parents)).bool(),
        siblings=row_tensor[:, None] == row_tensor[None, :],
        depth_tensor=depth_tensor,
        sibling_waves=tuple(zip(wave_nodes.split(wave_sizes), wave_before.split(wave_sizes))),
        judging_rows=judging,
        depths=tuple(depths.tolist()),
        has_children=tuple(row in last_child for row in range(len(parents) + 1)),
        chain=is_chain(parent_tensor),
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
        none if layout.chain else (layout.siblings & (drafts[:, None] == drafts[None, :])).sum() > drafts.shape[0],
    ]
    return torch.stack([flag.to(logits.device) for flag in flags])


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
        n = draft_tokens.shape[0]
        residual = torch.cat([(target_probs[:n] - draft_dists).clamp_(min=0.0), target_probs[n:]])
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


@dataclass(frozen=True)
class RowDraws:
    """The token to emit at a stop row, drawn only once the stop row is known.

    weights: FloatTensor[N+1, V], a non-negative (unnormalised) distribution per row. Only
    the stop row is sampled: drawing every row would cost N+1 cumulative sums over the
    vocabulary for one token.
    """

    weights: torch.Tensor
    generator: torch.Generator | None

    def at(self, row: torch.Tensor) -> torch.Tensor:
        """LongTensor[1]: a sample from the row ``row`` (LongTensor[1], on the device)."""
        return sample_rows(self.weights.index_select(0, row), self.generator)


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
    generator: torch.Generator | None,
) -> StrictOutcome:
    """Accept a draft x with probability min(1, p(x) / q(x)); on reject sample from the residual.

    target_probs: [N+1, V] processed target probabilities. A chain's rows use max(0, p - q)
    with the drafter's ``draft_dists`` when given. Tree drafts are deterministic (q one-hot),
    the multi-draft rule of SpecInfer: a sibling is tried on p renormalised without the
    earlier siblings' tokens, and after every child is rejected the correction is sampled
    from p without them. Randomness drawn: N uniforms, then (in ``finish``) one uniform for
    the stop row.
    """
    p_draft = at_nodes(target_probs, draft_tokens, layout)
    if draft_dists is None:
        mass = sibling_normalisers(p_draft, torch.ones_like(p_draft), layout)
        p_draft, q_draft = p_draft / mass.clamp(min=torch.finfo(mass.dtype).tiny), torch.ones_like(p_draft)
    else:
        q_draft = gather_at(draft_dists, draft_tokens)
    uniforms = torch.rand(draft_tokens.shape[0], generator=generator, device=target_probs.device)
    accepted = uniforms * q_draft < p_draft
    return StrictOutcome(accepted, RowDraws(residual_rows(target_probs, draft_tokens, draft_dists, layout), generator))


def first_choices(accepted: torch.Tensor, layout: TreeLayout, preferred: torch.Tensor | None = None) -> torch.Tensor:
    """BoolTensor[N]: the accepted node each row's walk takes: the first accepted sibling in
    draft order, or the first among the ``preferred`` accepted siblings when there are any."""
    count = accepted.shape[0]
    order = torch.arange(count, device=accepted.device)
    rank = order if preferred is None else order + count * (~preferred).long()
    beaten = layout.siblings & accepted[None, :] & (rank[None, :] < rank[:, None])
    return accepted & ~beaten.any(dim=1)


def finish(
    accepted: torch.Tensor,
    reasons: torch.Tensor,
    candidates: Candidates,
    prep: Prepared,
    preferred: torch.Tensor | None = None,
    row_trigger: torch.Tensor | None = None,
) -> Verdict:
    """Walk the tree, emit the stop row's candidate, and report the decisions, with one host transfer.

    accepted: BoolTensor[N], whether each node is accepted if reached; reasons: LongTensor[N]
    (the reason if reached); candidates: the token to emit per stop row (LongTensor[N+1]),
    or ``RowDraws`` to sample it from;
    preferred: BoolTensor[N] or None, nodes taken before their other accepted siblings;
    row_trigger: BoolTensor[N+1] or None, where the verifier's relaxation trigger fires per
    row (reported as ``Decisions.triggered`` at the visited depths; None: no trigger).
    Raises ValueError, after the transfer, if an input check failed.
    """
    layout, n = prep.layout, accepted.shape[0]
    chosen = first_choices(accepted, layout, preferred) if not layout.chain else accepted
    on_path = ~(layout.ancestors & ~chosen[None, :]).any(dim=1) if n else chosen
    accepted_len = on_path.sum().reshape(1)
    deepest = torch.where(on_path, layout.depth_tensor, -1).argmax().reshape(1) if n else accepted_len
    stop_row = torch.where(accepted_len > 0, deepest + 1, 0)
    emitted = candidates.at(stop_row) if isinstance(candidates, RowDraws) else candidates.gather(0, stop_row)
    parts = [emitted, on_path, reasons, prep.rows.z1, prep.rows.z2, prep.problems]
    if row_trigger is not None:
        parts.append(row_trigger)
    packed = torch.cat([part.double() for part in parts]).cpu()
    emitted, on_path, reasons, z1, z2, problems, *trigger = packed.split([part.numel() for part in parts])
    raise_on_problems(problems.tolist())
    next_token = int(emitted[0])
    path = sorted(torch.nonzero(on_path).flatten().tolist(), key=lambda node: layout.depths[node])
    stop = path[-1] + 1 if path else 0
    visited_nodes = path + ([-1] if layout.has_children[stop] else [])  # -1: the rejected depth
    visited_rows = [0] + [node + 1 for node in path]
    rows = torch.tensor(visited_rows[: len(visited_nodes)], dtype=torch.long)
    top1, top2 = z1.float()[rows], z2.float()[rows]
    decisions = Decisions(
        reasons=torch.tensor(
            [int(reasons[node]) if node >= 0 else int(Reason.REJECTED) for node in visited_nodes], dtype=torch.long
        ),
        top1_logit=top1,
        top2_logit=top2,
        margin=top2 / top1,
        triggered=trigger[0][rows].bool() if trigger else None,
    )
    return Verdict(accepted=torch.tensor(path, dtype=torch.long), next_token=next_token, decisions=decisions)


def reasons_from(accepted: torch.Tensor, accept_reason: torch.Tensor | Reason) -> torch.Tensor:
    """Reason per node: ``accept_reason`` where accepted, REJECTED elsewhere."""
    rejected = torch.full(accepted.shape, int(Reason.REJECTED), dtype=torch.long, device=accepted.device)
    if isinstance(accept_reason, Reason):
        accept_reason = torch.full_like(rejected, int(accept_reason))
    return torch.where(accepted, accept_reason, rejected)
