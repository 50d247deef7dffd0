"""``mars_ref``: the official MARS code's sampling branch, reproduced for chains and trees.

Follows ``evaluate_posterior`` in the official repository, where it differs from the paper's rule:
the trigger is the raw ratio z2 / (z1 + 1e-10) > theta with no guard, computed in float64
as the official code divides Python floats; a triggered position accepts a draft in the
top-2 set {t1, t2} deterministically and otherwise rejects with no randomness and no change
to p, the next token then being sampled from the unmodified p. An untriggered position uses
the drafter's q (``draft_probs``; q = 1 when the drafter gives none, as upstream EAGLE
does): accept when U <= min(1, p(x) / max(q, 1e-10)), otherwise subtract q from that one
coordinate of p, renormalise and sample the next token from it. After a fully accepted
chain the bonus is sampled from p. In greedy mode the official code does plain exact
matching, and so does this verifier (its trigger is then reported as firing nowhere). It reports
the statistics of ``mars`` (``mars.MARGIN_STATISTICS``) with its own trigger.

Trees follow the official walk: the trigger is decided once per row, children are tried in
draft order (a triggered row takes the first child in {t1, t2}, even a t2 drafted before
t1), and each strict rejection lowers p at that child's token before the next sibling is
tried.

Logits processing: where both top-k and top-p are set, the official code's
``prepare_logits_processor`` applies top-p, then top-k; every other verifier (and the
drafters) apply top-k, then top-p, transformers' order, which can keep fewer tokens
(``sampling.process_logits``). This verifier follows the official order, for its trigger,
its p and its emitted tokens alike.

Top-2 set: the official code takes it with ``torch.topk(row, 2)`` on the processed 1-D row, and
so does this verifier when sampling (``official_top_two``): for its trigger, the top-2 test of
every drafted node (chains and trees), its emission distribution (``emission``) and its reason
codes alike. Every other verifier, and this one in greedy mode (where the official code matches
``torch.argmax``), takes the project's top token, the first index of the row maximum
(``kernels.top_two``). The two sets differ only where logits tie: among equal logits and among
-inf entries (a runner-up filtered out by top-p or top-k) topk picks the indices in its own
order (on the CPU, [4, 4, 4, 0] gives {1, 2}, not {0, 1}). The logits its ``margin`` statistic
divides are the row's two largest values, which both definitions share, so it reads as ``mars``'s;
only which tokens carry them differs.
A triggered acceptance is EXACT where the draft is topk's first index and RELAXED otherwise, so
under a tie at the top an accepted draft with the top logit may count as RELAXED. With a
vocabulary of one, t2 = t1 and z2 = -inf, as ``kernels.top_two``.

It exists so that the margin effect and the change of q can be measured apart. Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from mars_bench.verification.base import Reason, Statistic, Verdict, VerifyInput, check_theta, register_verifier
from mars_bench.verification.emission import TINY, Emission, normalised, sequential
from mars_bench.verification.kernels import Prepared, RowDraws, TopTwo, at_nodes, finish, sibling_normalisers, top_two
from mars_bench.verification.mars import MARGIN_STATISTICS, margin_statistics
from mars_bench.verification.sampling import RandomStreams, SamplingParams, process_logits
from mars_bench.verification.strict import GreedyRule, TreeVerifier, top2_mask


@dataclass(frozen=True)
class MarsRefParams:
    """Settings of ``mars_ref``. theta: the ratio threshold in (0, 1]; None turns relaxation off."""

    theta: float | None = 0.9

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_theta(self.theta))


def reference_trigger(z1: torch.Tensor, z2: torch.Tensor, theta: float | None) -> torch.Tensor:
    """BoolTensor[R]: the official trigger z2 / (z1 + 1e-10) > theta, from the top-1 and
    runner-up logits [R], in float64 as the official code's Python floats (no guard)."""
    if theta is None:
        return torch.zeros_like(z1, dtype=torch.bool)
    return (z2.double() / (z1.double() + 1e-10)) > theta


def official_top_two(processed: torch.Tensor) -> TopTwo:
    """Top-2 of processed logits [R, V] as the official code takes it: ``torch.topk(row, 2)``,
    values and indices, in topk's own order among tied and -inf entries (row by row, as the
    official code's call on one 1-D row). V == 1: ``kernels.top_two`` (t2 = t1, z2 = -inf)."""
    if processed.shape[-1] < 2:
        return top_two(processed)
    values, indices = processed.topk(2, dim=-1)
    return TopTwo(values[:, 0], indices[:, 0], values[:, 1], indices[:, 1])


@dataclass(frozen=True)
class OfficialNodes:
    """Per row, the official trigger ([N+1]); per node, whether its token is in the row's top 2,
    the official strict ratio p / mass / q ([N]; kept when a uniform is <= it), and p with every
    node's token lowered by q * mass ([N+1, V], unnormalised: the correction after a rejection)."""

    row_trigger: torch.Tensor
    in_top2: torch.Tensor
    ratio: torch.Tensor
    lowered: torch.Tensor


@register_verifier("mars_ref", params=MarsRefParams)
class MarsReferenceVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    statistics: ClassVar[tuple[Statistic, ...]] = MARGIN_STATISTICS
    params: MarsRefParams

    def process(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Processed float32 logits [..., V]: top-p, then top-k, as the official code."""
        return process_logits(logits, sampling, order="top_p_first")

    def prepare(self, step: VerifyInput) -> tuple[VerifyInput, Prepared]:
        """The common start, with the official top-2 (``official_top_two``) for every row and node
        when sampling; greedy keeps the project's argmax, which the official greedy branch matches."""
        step, prep = super().prepare(step)
        if step.sampling.greedy:
            return step, prep
        rows = official_top_two(prep.processed)
        return step, replace(prep, rows=rows, nodes=rows.at(prep.layout.parent_rows))

    def official_nodes(self, step: VerifyInput, prep: Prepared) -> OfficialNodes:
        """The official code's per-node quantities of deterministic drafts (and of a chain's drafted tokens)."""
        drafts, top, probs = step.draft_tokens, prep.nodes, prep.probs
        q = torch.ones_like(drafts, dtype=probs.dtype) if step.draft_probs is None else step.draft_probs.float()
        p_draft = at_nodes(probs, drafts, prep.layout)
        mass = sibling_normalisers(p_draft, q, prep.layout)
        adjusted = probs.index_put((prep.layout.parent_rows, drafts), (p_draft - q * mass).clamp(min=0.0))
        return OfficialNodes(
            row_trigger=reference_trigger(prep.rows.z1, prep.rows.z2, self.params.theta),
            in_top2=(drafts == top.t1) | (drafts == top.t2),
            ratio=p_draft / mass.clamp(min=1e-10) / q.clamp(min=1e-10),
            lowered=adjusted,
        )

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        drafts, probs = step.draft_tokens, prep.probs
        nodes = self.official_nodes(step, prep)
        trigger = prep.parent_rows(nodes.row_trigger)
        uniforms = streams.node_uniforms(probs.device)
        strict_accept = uniforms <= nodes.ratio
        accepted = torch.where(trigger, nodes.in_top2, strict_accept)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        relaxed_reason = torch.where(drafts == prep.nodes.t1, int(Reason.EXACT), int(Reason.RELAXED))
        reasons = torch.where(
            trigger,
            torch.where(nodes.in_top2, relaxed_reason, rejected),
            torch.where(strict_accept, int(Reason.SAMPLED), rejected),
        )
        adjusted = torch.where(nodes.lowered.sum(-1, keepdim=True) > 0, nodes.lowered, probs)
        candidates = RowDraws(torch.where(nodes.row_trigger[:, None], probs, adjusted), streams)
        return finish(accepted, reasons, candidates, prep, statistics=margin_statistics(prep.rows, nodes.row_trigger))

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        """Exact matching, as the official greedy branch: the margin statistics with a trigger that fires nowhere."""
        rule = super().greedy_rule(step, prep)
        return replace(rule, statistics=margin_statistics(prep.rows, torch.zeros_like(prep.rows.t1, dtype=torch.bool)))

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """Deterministic drafts: each child kept with its official-code probability, the correction
        p (triggered rows) or p lowered by q at the children's tokens. With ``draft_dists`` the
        lowered coordinate is the sampled token's own, so P_V sums a correction per token:
        P_V(y) = q(y) a(y) + c p(y) - q(y) (1 - a(y)) m(y) / (1 - m(y)), m = min(p, q),
        c = sum_x q(x) (1 - a(x)) / (1 - m(x)), where the row is not triggered."""
        drafts, layout, probs = step.draft_tokens, prep.layout, prep.probs
        row_trigger = reference_trigger(prep.rows.z1, prep.rows.z2, self.params.theta)
        if step.draft_dists is None:
            nodes = self.official_nodes(step, prep)
            accept = torch.where(prep.parent_rows(row_trigger), nodes.in_top2.float(), nodes.ratio.clamp(max=1.0))
            correction = torch.where(row_trigger[:, None], probs, normalised(nodes.lowered, probs))
            return sequential(accept, drafts, correction, layout)
        proposal, p, trigger = step.draft_dists.float(), layout.drafted_rows(probs), layout.drafted_rows(row_trigger)[:, None]
        q_used = proposal if step.draft_probs is not None else torch.ones_like(proposal)
        accept = torch.where(trigger, top2_mask(prep).float(), (p / q_used.clamp(min=1e-10)).clamp(max=1.0))
        rejected = proposal * (1.0 - accept)
        lowered = torch.minimum(p, q_used)
        kept_share = (1.0 - lowered).clamp(min=TINY)
        untriggered = proposal * accept + p * (rejected / kept_share).sum(-1, keepdim=True) - rejected * lowered / kept_share
        triggered = proposal * accept + p * rejected.sum(-1, keepdim=True)
        dist = torch.where(trigger, triggered, untriggered)
        return Emission(dist, (proposal * accept).sum(-1), layout.judging_rows)
