"""Medusa's typical acceptance (Cai et al. 2024): accept a draft whose target probability
exceeds min(epsilon, delta * exp(-H(p))), H the entropy of the processed target
distribution p. A reject emits a sample from p; a fully accepted chain a bonus sample from
p. Trees: the first accepted child in draft order. Greedy mode is ``exact``, as in Medusa.
Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import Reason, Verdict, VerifyInput, check_unit_interval, register_verifier
from mars_bench.verification.emission import Emission
from mars_bench.verification.kernels import Prepared, RowDraws, at_nodes, finish, reasons_from
from mars_bench.verification.sampling import RandomStreams
from mars_bench.verification.strict import TreeVerifier, accept_then_correct


@dataclass(frozen=True)
class TypicalParams:
    """Settings of ``typical``: epsilon (the probability cap) and delta (the entropy factor), each in (0, 1]."""

    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self) -> None:
        for option in ("epsilon", "delta"):
            object.__setattr__(self, option, check_unit_interval(option, getattr(self, option)))


@register_verifier("typical", params=TypicalParams)
class TypicalVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    params: TypicalParams

    def threshold(self, probs: torch.Tensor) -> torch.Tensor:
        """FloatTensor[R]: min(epsilon, delta * exp(-H(p))) per row of p [R, V]."""
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
        return torch.minimum(torch.full_like(entropy, self.params.epsilon), self.params.delta * torch.exp(-entropy))

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        top, drafts = prep.nodes, step.draft_tokens
        probs = prep.probs
        accepted = at_nodes(probs, drafts, prep.layout) > prep.parent_rows(self.threshold(probs))
        accept_reason = torch.where(drafts == top.t1, int(Reason.EXACT), int(Reason.RELAXED))
        return finish(accepted, reasons_from(accepted, accept_reason), RowDraws(probs, streams), prep)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        probs = prep.probs
        threshold = self.threshold(probs)
        if step.draft_dists is None:
            accept = at_nodes(probs, step.draft_tokens, prep.layout) > prep.parent_rows(threshold)
        else:
            layout = prep.layout
            accept = layout.drafted_rows(probs) > layout.drafted_rows(threshold)[:, None]
        return accept_then_correct(step, prep, accept.float(), probs)
