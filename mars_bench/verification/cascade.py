"""``cascade``: token-level speculative cascades (Narasimhan et al., "Faster Cascades via Speculative
Decoding", ICLR 2025). A deferral rule decides per position whether to keep the drafter's
distribution (pi = q) or defer to the target (pi = p); the draft is then rejection-sampled toward
pi (a(x) = min(1, pi(x) / q(x)), correction norm(max(0, pi - q))), so P_V = pi.

Deferral rules (``rule``), with c the drafter's confidence (its largest probability):
- ``chow``: keep the drafter where c > 1 - alpha, alpha in [0, 1]. alpha = 0 is ``rejection``
  (the paper's non-strict form would keep a one-hot q at alpha = 0; the strict one does not).
- ``opt``: their plug-in optimal rule, keep the drafter where c > max p - alpha TV(p, q),
  alpha >= -1. Since max q - max p <= TV(p, q), alpha = -1 is ``rejection``.

Greedy, as the authors' code does it: the confidences are temperature-1 probabilities (the
drafter's ``draft_probs``, the target's softmax), the TV term is between the one-hot argmaxes
(1 where the draft is not the target's argmax); a kept drafter keeps its draft. Chains only.
Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mars_bench.verification.base import VerifyInput, check_choice, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule, total_variation, toward
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule

RULES = ("chow", "opt")
LOWEST_ALPHA = {"chow": 0.0, "opt": -1.0}  # the lossless value of each rule


@dataclass(frozen=True)
class CascadeParams:
    """Settings of ``cascade``: the deferral ``rule`` (chow | opt) and its ``alpha`` (chow: [0, 1];
    opt: >= -1; the lowest value is the strict rule)."""

    rule: str = "chow"
    alpha: float = 0.3

    def __post_init__(self) -> None:
        check_choice("rule", self.rule, RULES)
        high, allowed = (1.0, "a number in [0, 1]") if self.rule == "chow" else (math.inf, "a finite number >= -1")
        alpha = check_range("alpha", self.alpha, LOWEST_ALPHA[self.rule], high, f"{allowed} for rule={self.rule}")
        object.__setattr__(self, "alpha", alpha)


@register_verifier("cascade", params=CascadeParams)
class CascadeVerifier(ChainRule):
    __doc__ = __doc__
    params: CascadeParams

    def keep_drafter(self, confidence: torch.Tensor, top_p: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """BoolTensor[D]: where the deferral rule keeps the drafter's distribution."""
        if self.params.rule == "chow":
            return confidence > 1.0 - self.params.alpha
        return confidence > top_p - self.params.alpha * distance

    def row_rule(self, rows: ChainRows) -> RowRule:
        keep = self.keep_drafter(rows.confidence, rows.p.max(dim=-1).values, total_variation(rows.p, rows.q))
        return toward(torch.where(keep[:, None], rows.q, rows.p), rows.q)

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        p1 = self.greedy_rows(step, prep)
        off_argmax = (step.draft_tokens != prep.nodes.t1).float()
        return self.greedy_with(step, prep, self.keep_drafter(self.confidence(step), p1.max(dim=-1).values, off_argmax))
