"""``mars_ref``: the official MARS code's sampling branch, reproduced for chains and trees.

Follows ``evaluate_posterior`` in the official repository (see reference/mars.md 1.3b):
the trigger is the raw ratio z2 / (z1 + 1e-10) > theta with no guard; a triggered
position accepts a draft in the top-2 set {t1, t2} deterministically and otherwise rejects
with no randomness and no change to p, the next token then being sampled from the
unmodified p. An untriggered position uses the drafter's q (``draft_probs``; q = 1 when the
drafter gives none, as upstream EAGLE does): accept when U <= min(1, p(x) / max(q, 1e-10)),
otherwise subtract q from that one coordinate of p, renormalise and sample the next token
from it. After a fully accepted chain the bonus is sampled from p. In greedy mode the
official code does plain exact matching, and so does this verifier.

Trees follow the official walk: the trigger is decided once per row, children are tried in
draft order (a triggered row takes the first child in {t1, t2}, even a t2 drafted before
t1), and each strict rejection lowers p at that child's token before the next sibling is
tried.

It exists so that the margin effect and the change of q can be measured apart. Not lossless.
"""

from __future__ import annotations

import torch

from mars_bench.verification.base import Reason, Verdict, VerifyInput, register_verifier
from mars_bench.verification.kernels import Prepared, RowDraws, at_nodes, finish, sibling_normalisers
from mars_bench.verification.mars import check_theta
from mars_bench.verification.sampling import probabilities
from mars_bench.verification.strict import TreeVerifier


@register_verifier("mars_ref")
class MarsReferenceVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False

    def __init__(self, theta: float | None = 0.9) -> None:
        self.theta = check_theta(theta)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "theta": self.theta}

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        top, drafts, layout = prep.nodes, step.draft_tokens, prep.layout
        probs = probabilities(prep.processed, step.sampling)
        if self.theta is None:
            row_trigger = torch.zeros_like(prep.rows.z1, dtype=torch.bool)
        else:
            row_trigger = (prep.rows.z2 / (prep.rows.z1 + 1e-10)) > self.theta
        trigger = prep.parent_rows(row_trigger)
        in_top2 = (drafts == top.t1) | (drafts == top.t2)
        q = torch.ones_like(drafts, dtype=probs.dtype) if step.draft_probs is None else step.draft_probs.float()
        p_draft = at_nodes(probs, drafts, prep.layout)
        mass = sibling_normalisers(p_draft, q, layout)
        uniforms = torch.rand(drafts.shape[0], generator=generator, device=probs.device)
        strict_accept = uniforms <= p_draft / mass.clamp(min=1e-10) / q.clamp(min=1e-10)
        accepted = torch.where(trigger, in_top2, strict_accept)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        relaxed_reason = torch.where(drafts == top.t1, int(Reason.EXACT), int(Reason.RELAXED))
        reasons = torch.where(
            trigger,
            torch.where(in_top2, relaxed_reason, rejected),
            torch.where(strict_accept, int(Reason.SAMPLED), rejected),
        )
        adjusted = probs.index_put((layout.parent_rows, drafts), (p_draft - q * mass).clamp(min=0.0))
        adjusted = torch.where(adjusted.sum(-1, keepdim=True) > 0, adjusted, probs)
        return finish(accepted, reasons, RowDraws(torch.where(row_trigger[:, None], probs, adjusted), generator), prep)
