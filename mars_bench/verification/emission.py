"""The exact distribution of the token a verifier emits, and what it costs against the target.

At one judged position with processed target probabilities p, a proposal q (the drafter's
distribution, or one-hot at a deterministic draft), an acceptance function a(x) and a
correction distribution r drawn from after a rejection, the emitted token is distributed as

    P_V(y) = sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) r_x(y)],    alpha_V = sum_x q(x) a(x).

A verifier's ``emission`` builds P_V and alpha_V for every row that judges drafts, from its
own rule and settings, with no sampling and no loop over the vocabulary. The pieces here
are the shared algebra: ``mix`` for one proposal per row with a correction that does not
depend on the rejected token, ``sequential`` for deterministic drafts tried one sibling
after another (chains and trees), ``greedy_emission`` for greedy rules (P_V one-hot), and
``fidelity`` for the per-position cost: KL(P_V || p) and TV(P_V, p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mars_bench.verification.kernels import TreeLayout, first_choices

TINY = 1e-30
FLOOR = 2.0**-23  # the smallest ratio P / p that ``fidelity`` resolves: float32's epsilon


@dataclass(frozen=True)
class Emission:
    """What a verifier emits at R judged rows (``rows``: the target-logits rows that judge drafts,
    ascending; for a chain of D drafts rows 0..D-1, one per drafted position).

    dist: FloatTensor[R, V], P_V per row (each row sums to 1).
    accept: FloatTensor[R], alpha_V: the probability that the row's walk keeps a draft.
    rows: LongTensor[R].
    """

    dist: torch.Tensor
    accept: torch.Tensor
    rows: torch.Tensor


def normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of non-negative ``weights`` [R, V] scaled to sum to 1; ``fallback``'s row where a row is empty."""
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp(min=TINY), fallback)


def proposal_rows(draft_tokens: torch.Tensor, draft_dists: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """FloatTensor[D, V]: the drafter's proposal per chain position, one-hot at a deterministic draft."""
    if draft_dists is not None:
        return draft_dists.float()
    one_hot = torch.zeros(draft_tokens.shape[0], vocab, device=draft_tokens.device)
    return one_hot.scatter_(-1, draft_tokens[:, None], 1.0)


def mix(proposal: torch.Tensor, accept: torch.Tensor, correction: torch.Tensor, rows: torch.Tensor) -> Emission:
    """P_V = q * a + (1 - alpha) r for one proposal per row.

    proposal: q [R, V]; accept: a(x) [R, V] in [0, 1]; correction: r [R, V], normalised, the
    same whichever token was rejected (a rule whose correction depends on it builds P_V itself).
    """
    kept = proposal * accept
    alpha = kept.sum(dim=-1)
    return Emission(kept + (1.0 - alpha).clamp(min=0.0)[:, None] * correction, alpha, rows)


def sequential(node_accept: torch.Tensor, draft_tokens: torch.Tensor, correction: torch.Tensor, layout: TreeLayout) -> Emission:
    """P_V per judging row for deterministic drafts tried in draft order (a chain: one per row).

    node_accept: FloatTensor[N], the probability that each node is kept when its turn comes
    (every earlier sibling rejected); correction: FloatTensor[N+1, V], each row's normalised
    distribution after all its children are rejected. The k-th child is reached with the
    product of (1 - a) over its earlier siblings: one small step per sibling rank, as
    ``kernels.sibling_normalisers``.
    """
    reach = torch.ones_like(node_accept)
    for nodes, before in layout.sibling_waves:
        reach[nodes] = reach[before] * (1.0 - node_accept[before])
    kept = reach * node_accept  # [N]: the probability that the walk takes each node
    rows = layout.judging_rows
    total = torch.zeros(correction.shape[0], device=kept.device).index_add_(0, layout.parent_rows, kept)
    dist = correction * (1.0 - total).clamp(min=0.0)[:, None]
    dist = dist.index_put((layout.parent_rows, draft_tokens), kept, accumulate=True)
    return Emission(dist[rows], total[rows], rows)


def greedy_emission(
    accepted: torch.Tensor,
    draft_tokens: torch.Tensor,
    candidates: torch.Tensor,
    layout: TreeLayout,
    vocab: int,
    preferred: torch.Tensor | None = None,
) -> Emission:
    """One-hot P_V per judging row of a greedy rule: the child the walk takes there
    (``kernels.first_choices``), else the row's candidate token (LongTensor[N+1])."""
    chosen = first_choices(accepted, layout, preferred) if not layout.chain else accepted
    token = candidates.clone()
    token[layout.parent_rows[chosen]] = draft_tokens[chosen]
    taken = torch.zeros(candidates.shape[0], device=accepted.device).index_add_(0, layout.parent_rows, chosen.float())
    rows = layout.judging_rows
    dist = torch.zeros(rows.shape[0], vocab, device=accepted.device).scatter_(-1, token[rows][:, None], 1.0)
    return Emission(dist, taken[rows], rows)


def split_emission(emission: Emission, layout: TreeLayout) -> list[Emission]:
    """A batched step's emission (over the batch's rows) as one Emission per request, in the request's own rows."""
    starts = torch.searchsorted(emission.rows, layout.root_row_tensor).tolist() + [emission.rows.shape[0]]
    sizes = [end - start for start, end in zip(starts, starts[1:])]
    parts = zip(emission.dist.split(sizes), emission.accept.split(sizes), emission.rows.split(sizes), layout.root_rows)
    return [Emission(dist, accept, rows - root) for dist, accept, rows, root in parts]


@dataclass(frozen=True)
class Fidelity:
    """Per judged row ([R] each): alpha_V, KL(P_V || p) in nats (None when p is one-hot: greedy),
    TV(P_V, p) (in greedy mode 1 where the emitted token is not the target's argmax), and
    TV(q, p) for the bound alpha_V <= 1 - TV(q, p) + TV(P_V, p) (None for trees)."""

    accept: torch.Tensor
    kl: torch.Tensor | None
    tv: torch.Tensor
    draft_tv: torch.Tensor | None


def fidelity(
    emission: Emission, target_probs: torch.Tensor, proposal: torch.Tensor | None = None, with_kl: bool = True
) -> Fidelity:
    """The cost of ``emission`` against the target's processed p at the same rows.

    target_probs: [R, V] p, float32 as every verifier and the baseline sample from it; proposal:
    [R, V] q for the bound (chains), or None; with_kl: False in greedy mode (p one-hot). KL is
    +inf where P_V puts mass on a token p gives probability 0 (filtered, or below float32's
    range: the target never emits it). It is summed as P log1p((P - p) / p) - (P - p), whose
    terms are all non-negative and whose first-order rounding cancels: a lossless rule's P_V,
    equal to p up to float32 rounding, comes out at a KL near 1e-12 instead of the 1e-7 that two
    rounded float32 logarithms would leave. Where P < 1.2e-7 p, log(P / p) is taken as log(1.2e-7),
    which moves the KL by less than 5e-8 p.
    """
    dist = emission.dist
    difference = dist - target_probs
    tv = 0.5 * difference.abs().sum(dim=-1)
    kl = None
    if with_kl:
        relative = (difference / target_probs).clamp_(min=FLOOR - 1.0)  # P / p - 1; inf where p = 0 < P
        terms = (dist * relative.log1p_()).nan_to_num_(nan=0.0, posinf=math.inf).sub_(difference)  # nan: P = p = 0
        kl = terms.sum(dim=-1).clamp_(min=0.0)
    draft_tv = None if proposal is None else 0.5 * (proposal - target_probs).abs().sum(dim=-1)
    return Fidelity(emission.accept, kl, tv, draft_tv)
