"""``tv_budget``: the largest acceptance whose output stays within total variation eps of the target.

Move eps of p's mass from where p > q to where q > p: pi = (1 - t) p + t q with
t = min(1, eps / TV(p, q)), then rejection-sample toward pi. It emits pi, TV(pi, p) =
min(eps, TV(p, q)) and accepts with probability min(1, 1 - TV(p, q) + eps), which is the bound
no rule can beat at that TV (see docs/fidelity.md). Greedy: p is one-hot, so any other token
costs TV 1: keep only the argmax unless eps = 1. eps = 0 is ``rejection`` (``exact`` in greedy
mode). Chains only. Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import VerifyInput, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule, total_variation, toward
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule


@dataclass(frozen=True)
class TvBudgetParams:
    """Settings of ``tv_budget``: eps, the total-variation budget per position, in [0, 1]."""

    eps: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_range("eps", self.eps, 0.0, 1.0, "a number in [0, 1] (0 = the strict rule)"))


@register_verifier("tv_budget", params=TvBudgetParams)
class TvBudgetVerifier(ChainRule):
    __doc__ = __doc__
    params: TvBudgetParams

    def row_rule(self, rows: ChainRows) -> RowRule:
        distance = total_variation(rows.p, rows.q)
        share = (self.params.eps / distance.clamp(min=1e-30)).clamp(max=1.0)[:, None]
        return toward((1.0 - share) * rows.p + share * rows.q, rows.q)

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        self.greedy_rows(step, prep)
        return self.greedy_with(step, prep, torch.full_like(step.draft_tokens, self.params.eps >= 1, dtype=torch.bool))
