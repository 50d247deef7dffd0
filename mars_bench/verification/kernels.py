"""Batched tensor pieces shared by the chain verifiers (no Python loop per token).

Every verifier computes, for all N drafted positions at once, whether the draft there
would be accepted if reached, why, and which token to emit if the path stops there
(row N holds the bonus token). ``finish`` then takes the longest accepted prefix and
moves the result to the host in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import Decisions, Reason, Verdict, VerifyInput
from mars_bench.verification.sampling import sample_rows


@dataclass(frozen=True)
class TopTwo:
    """The two largest processed logits per row ([R] each); t2 == t1 when V == 1."""

    z1: torch.Tensor
    t1: torch.Tensor
    z2: torch.Tensor
    t2: torch.Tensor

    @property
    def margin(self) -> torch.Tensor:
        """The MARS statistic z2 / z1, as the paper defines it (no guard)."""
        return self.z2 / self.z1


PROBLEMS = (
    "target_logits contain NaN",
    "target_logits contain +inf",
    "a target_logits row has no finite entry",
    "a draft token is outside the vocabulary",
    "draft_probs are not probabilities in [0, 1]",
    "draft_dists are not non-negative distributions",
)


def input_problems(step: VerifyInput) -> torch.Tensor:
    """BoolTensor[len(PROBLEMS)] on the device: which input checks fail (no host sync)."""
    logits, drafts = step.target_logits, step.draft_tokens
    none = torch.zeros((), dtype=torch.bool, device=logits.device)
    flags = [
        torch.isnan(logits).any(),
        torch.isposinf(logits).any(),
        (~torch.isfinite(logits)).all(dim=-1).any(),
        ((drafts < 0) | (drafts >= logits.shape[-1])).any() if drafts.numel() else none,
        none if step.draft_probs is None else ~((step.draft_probs >= 0) & (step.draft_probs <= 1 + 1e-4)).all(),
        none if step.draft_dists is None else ~(step.draft_dists >= 0).all(),
    ]
    return torch.stack([flag.to(logits.device) for flag in flags])


@dataclass(frozen=True)
class Prepared:
    """What every chain verifier starts from: processed logits [N+1, V], the top-2 of the N
    drafted rows, and the input checks still on the device."""

    processed: torch.Tensor
    top: TopTwo
    problems: torch.Tensor


def top_two(processed: torch.Tensor) -> TopTwo:
    """Top-2 of processed logits [R, V]."""
    if processed.shape[-1] < 2:
        z1, t1 = processed.max(dim=-1)
        return TopTwo(z1, t1, torch.full_like(z1, float("-inf")), t1)
    values, indices = torch.topk(processed, 2, dim=-1)
    return TopTwo(values[:, 0], indices[:, 0], values[:, 1], indices[:, 1])


def gather_at(rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """rows[i, tokens[i]] for rows [N, V] and tokens [N]."""
    return rows.gather(-1, tokens[:, None]).squeeze(-1)


def residual_rows(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_dists: torch.Tensor | None) -> torch.Tensor:
    """Unnormalised max(0, p - q) per drafted position ([N, V]); falls back to p where it is all zero.

    With ``draft_dists`` None the proposal was deterministic, so q is one-hot at the draft.
    """
    if draft_dists is None:
        residual = target_probs.scatter(-1, draft_tokens[:, None], 0.0)
    else:
        residual = (target_probs - draft_dists).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, target_probs, residual)


@dataclass(frozen=True)
class StrictOutcome:
    """The Leviathan / Chen rule per position: accepted[N] and the token to emit at each stop [N+1]."""

    accepted: torch.Tensor
    candidates: torch.Tensor


def strict_rejection(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_dists: torch.Tensor | None,
    generator: torch.Generator | None,
) -> StrictOutcome:
    """Accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); on reject sample from norm(max(0, p - q)).

    target_probs: [N+1, V] processed target probabilities; the bonus row N is sampled from p.
    Randomness drawn: N uniforms, then one exponential race over [N+1, V].
    """
    n = draft_tokens.shape[0]
    p_draft = gather_at(target_probs[:n], draft_tokens)
    q_draft = torch.ones_like(p_draft) if draft_dists is None else gather_at(draft_dists, draft_tokens)
    uniforms = torch.rand(n, generator=generator, device=target_probs.device)
    accepted = uniforms * q_draft < p_draft
    rows = torch.cat([residual_rows(target_probs[:n], draft_tokens, draft_dists), target_probs[n:]])
    return StrictOutcome(accepted, sample_rows(rows, generator))


def finish(
    accepted: torch.Tensor,
    reasons: torch.Tensor,
    candidates: torch.Tensor,
    prep: Prepared,
) -> Verdict:
    """Longest accepted prefix, its correction / bonus token and the decisions, with one host transfer.

    accepted: BoolTensor[N]; reasons: LongTensor[N] (the reason if reached); candidates:
    LongTensor[N+1]. Raises ValueError, after the transfer, if an input check failed.
    """
    top = prep.top
    n = accepted.shape[0]
    accepted_len = torch.cumprod(accepted.long(), dim=0).sum().reshape(1) if n else accepted.new_zeros(1, dtype=torch.long)
    next_token = candidates.gather(0, accepted_len)
    packed = torch.cat(
        [
            accepted_len.double(),
            next_token.double(),
            reasons.double(),
            top.z1.double(),
            top.z2.double(),
            prep.problems.double(),
        ]
    ).cpu()
    failed = [problem for problem, flag in zip(PROBLEMS, packed[2 + 3 * n :].tolist()) if flag]
    if failed:
        raise ValueError("invalid verifier input: " + "; ".join(failed))
    count = int(packed[0])
    visited = min(count + 1, n)
    z1 = packed[2 + n : 2 + n + visited].float()
    z2 = packed[2 + 2 * n : 2 + 2 * n + visited].float()
    decisions = Decisions(
        reasons=packed[2 : 2 + visited].long(),
        top1_logit=z1,
        top2_logit=z2,
        margin=z2 / z1,
    )
    return Verdict(accepted=torch.arange(count), next_token=int(packed[1]), decisions=decisions)


def reasons_from(accepted: torch.Tensor, accept_reason: torch.Tensor | Reason) -> torch.Tensor:
    """Reason per position: ``accept_reason`` where accepted, REJECTED elsewhere."""
    rejected = torch.full(accepted.shape, int(Reason.REJECTED), dtype=torch.long, device=accepted.device)
    if isinstance(accept_reason, Reason):
        accept_reason = torch.full_like(rejected, int(accept_reason))
    return torch.where(accepted, accept_reason, rejected)
