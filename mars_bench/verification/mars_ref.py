"""``mars_ref``: the official MARS code's sampling branch, reproduced for chains.

Follows ``evaluate_posterior`` in the official repository (see reference/mars.md 1.3b):
the trigger is the raw ratio z2 / (z1 + 1e-10) > theta with no guard; a triggered
position accepts a draft in the top-2 set {t1, t2} deterministically and otherwise rejects
with no randomness and no change to p, the next token then being sampled from the
unmodified p. An untriggered position uses the drafter's q (``draft_probs``; q = 1 when the
drafter gives none, as upstream EAGLE does): accept when U <= min(1, p(x) / max(q, 1e-10)),
otherwise subtract q from that one coordinate of p, renormalise and sample the next token
from it. After a fully accepted chain the bonus is sampled from p. In greedy mode the
official code does plain exact matching, and so does this verifier.

It exists so that the margin effect and the change of q can be measured apart. Not lossless.
"""

from __future__ import annotations

import torch

from mars_bench.verification.base import Reason, Verdict, VerifyInput, register_verifier
from mars_bench.verification.kernels import Prepared, finish, gather_at
from mars_bench.verification.mars import check_theta
from mars_bench.verification.sampling import probabilities, sample_rows
from mars_bench.verification.strict import ChainVerifier


@register_verifier("mars_ref")
class MarsReferenceVerifier(ChainVerifier):
    __doc__ = __doc__
    lossless = False

    def __init__(self, theta: float | None = 0.9) -> None:
        self.theta = check_theta(theta)

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "theta": self.theta}

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        processed, top = prep.processed, prep.top
        n, drafts = step.num_drafts, step.draft_tokens
        probs = probabilities(processed, step.sampling)
        if self.theta is None:
            trigger = torch.zeros_like(drafts, dtype=torch.bool)
        else:
            trigger = (top.z2 / (top.z1 + 1e-10)) > self.theta
        in_top2 = (drafts == top.t1) | (drafts == top.t2)
        q = torch.ones(n, device=probs.device) if step.draft_probs is None else step.draft_probs.float()
        p_draft = gather_at(probs[:n], drafts)
        uniforms = torch.rand(n, generator=generator, device=probs.device)
        strict_accept = uniforms <= p_draft / q.clamp(min=1e-10)
        accepted = torch.where(trigger, in_top2, strict_accept)
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        relaxed_reason = torch.where(drafts == top.t1, int(Reason.EXACT), int(Reason.RELAXED))
        reasons = torch.where(
            trigger,
            torch.where(in_top2, relaxed_reason, rejected),
            torch.where(strict_accept, int(Reason.SAMPLED), rejected),
        )
        adjusted = probs[:n].scatter(-1, drafts[:, None], (p_draft - q).clamp(min=0.0)[:, None])
        adjusted = torch.where(adjusted.sum(-1, keepdim=True) > 0, adjusted, probs[:n])
        correction_rows = torch.where(trigger[:, None], probs[:n], adjusted)
        candidates = sample_rows(torch.cat([correction_rows, probs[n:]]), generator)
        return finish(accepted, reasons, candidates, prep)
