"""What each verifier's output costs against the target, step by step (``decode(..., fidelity=True)``).

At every drafted position of a chain (for a tree: every row the live walk visited that judges
drafts) the live verifier and each shadow verifier give their exact P_V and alpha_V
(``Verifier.emission``); this module turns them into per-position acceptance, KL(P_V || p) and
TV(P_V, p) against the target's processed p, with one host transfer per step, and sums them
per decoded sequence for the records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mars_bench.verification import Verifier, VerifyInput
from mars_bench.verification.emission import Emission, fidelity, proposal_rows
from mars_bench.verification.kernels import target_view
from mars_bench.verification.sampling import process_logits
from mars_bench.verification.strict import TreeVerifier


@dataclass
class PositionCosts:
    """One verifier at one step, per judged position (lists of equal length): alpha_V, KL in
    nats (None in greedy mode), TV, and TV(q, p) for the bound (None for trees). ``judged``:
    how many of the positions, from the first, this verifier's own walk reached."""

    accept: list[float]
    kl: list[float] | None
    tv: list[float]
    draft_tv: list[float] | None
    judged: int


def step_costs(
    verifiers: Sequence[Verifier], step: VerifyInput, accepted_lens: Sequence[int], live_path: list[int], chain: bool
) -> list[PositionCosts]:
    """Per verifier (live first), the costs of one verified step.

    accepted_lens: drafts each verifier's own walk kept, in the order of ``verifiers``;
    live_path: the live verdict's accepted nodes (a tree's positions are the rows it visited).
    """
    sampling = step.sampling
    view = target_view(step.target_logits, sampling, process_logits, TreeVerifier.process)  # the verifiers' own
    if chain:
        rows = torch.arange(step.num_drafts, device=view.processed.device)
    else:
        judging = set(step.parents.tolist())
        visited = [0] + [node + 1 for node in live_path]
        rows = torch.tensor([row for row in visited if row - 1 in judging], dtype=torch.long, device=view.processed.device)
    target = view.probs[: step.num_drafts] if chain else view.probs[rows]
    parts = []
    if chain:
        proposal = proposal_rows(step.draft_tokens, step.draft_dists, target.shape[-1])
        parts.append(0.5 * (proposal - target).abs().sum(dim=-1))  # TV(q, p), the same for every verifier
    for verifier in verifiers:
        emission = verifier.emission(step)
        if not chain:  # the rows the live walk visited, of every judging row (ascending)
            index = torch.searchsorted(emission.rows, rows)
            emission = Emission(emission.dist[index], emission.accept[index], rows)
        costs = fidelity(emission, target, with_kl=not sampling.greedy)
        parts += [costs.accept, costs.tv] + ([] if costs.kl is None else [costs.kl])
    values = torch.stack(parts).double().cpu().tolist()  # one transfer
    draft_tv = values.pop(0) if chain else None
    per_verifier = len(values) // len(verifiers)
    result = []
    for index, kept in enumerate(accepted_lens):
        accept, tv, *kl = values[index * per_verifier : (index + 1) * per_verifier]
        judged = min(kept + 1, len(rows)) if chain else len(rows)
        result.append(PositionCosts(accept, kl[0] if kl else None, tv, draft_tv, judged))
    return result


def expected_accepted(accept: list[float]) -> float:
    """E[kept drafts] of a chain whose positions keep their draft with ``accept`` independently
    once reached: sum over k of the product of the first k + 1 probabilities."""
    total, reach = 0.0, 1.0
    for alpha in accept:
        reach *= alpha
        total += reach
    return total


def _sum(values: list[float] | None) -> float | None:
    if values is None:
        return None
    total = math.fsum(values)
    return total if math.isfinite(total) else None


def sequence_costs(steps: Sequence[PositionCosts]) -> dict[str, float | int | None]:
    """One verifier's costs summed over a decoded sequence's steps (the records' ``fidelity`` entry).

    A KL sum is None in greedy mode and where some position's KL is infinite (``kl_infinite``
    counts those positions). Expected kept drafts and TV(q, p) are summed for chains only."""
    chain = bool(steps) and all(step.draft_tv is not None for step in steps)
    every = lambda name: [value for step in steps for value in getattr(step, name)]  # noqa: E731
    judged = lambda name: [value for step in steps for value in getattr(step, name)[: step.judged]]  # noqa: E731
    greedy = any(step.kl is None for step in steps)
    kl = None if greedy else every("kl")
    return {
        "positions": sum(len(step.accept) for step in steps),
        "accept": math.fsum(every("accept")),
        "kl": _sum(kl),
        "kl_infinite": None if kl is None else sum(not math.isfinite(value) for value in kl),
        "tv": math.fsum(every("tv")),
        "draft_tv": math.fsum(every("draft_tv")) if chain else None,
        "expected_accepted": math.fsum(expected_accepted(step.accept) for step in steps) if chain else None,
        "steps": len(steps),
        "judged": sum(step.judged for step in steps),
        "judged_kl": None if greedy else _sum(judged("kl")),
        "judged_tv": math.fsum(judged("tv")),
    }
