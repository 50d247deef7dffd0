"""``fsd``: fuzzy speculative decoding (Holsman, Huang and Dhingra, arXiv 2502.20704, Findings of ACL 2025).

Keep the draft at a position iff D(p, q) <= T, D a divergence between the whole distributions
(``divergence``: ``js`` Jensen-Shannon, ``kl`` KL(q || p), both in nats, or ``tv`` total variation),
so the test does not depend on which token was drafted. p is the target's processed distribution,
q the drafter's (``draft_dists``), one-hot at a deterministic draft, where KL(q || p) = -log p(x).

Where D > T (``residual``): ``target`` (default) rejects and emits a sample from p, as the authors'
code and SecureSD (``securesd/verifier/fsd.py``) do; ``strict`` judges the draft by the strict rule
there instead (min(1, p / q), then a sample from norm(max(0, p - q))). Either way P_V = q where
D <= T and p elsewhere; ``strict`` keeps more drafts. T = 0 is lossless (D = 0 only where p = q,
to float rounding), and with ``residual=strict`` it is ``rejection`` exactly.

The authors' code measures D on the temperature-1 softmax of the unprocessed logits by default (its
``*_processed`` divergences on the processed ones) and its ``kl_div`` is KL(q || p); SecureSD's
is KL(p || q), on temperature-1 softmaxes. Here D is on the processed p and the drafter's
processed q, the distributions the rule emits.

Greedy: p and q are point masses (the target's argmax, the drafted token), so D is 0 at the argmax
and ln 2 (js), 1 (tv) or infinite (kl) elsewhere: the argmax is kept, and any draft once T reaches
that value. The drafter's temperature-1 distribution, which SecureSD's greedy path measures, does
not reach a verifier in greedy mode. Chains only. Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mars_bench.verification.base import VerifyInput, check_choice, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule
from mars_bench.verification.emission import TINY
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule

DIVERGENCES = ("js", "kl", "tv")
RESIDUALS = ("target", "strict")
POINT_MASSES_APART = {"js": math.log(2.0), "kl": math.inf, "tv": 1.0}  # D between two different point masses


@dataclass(frozen=True)
class FsdParams:
    """Settings of ``fsd``: the ``divergence`` (js | kl | tv), its ``threshold`` T >= 0 (0 = lossless) and
    the ``residual`` where D > T (target: reject, sample p; strict: the strict rule)."""

    divergence: str = "js"
    threshold: float = 0.2
    residual: str = "target"

    def __post_init__(self) -> None:
        check_choice("divergence", self.divergence, DIVERGENCES)
        allowed = "a finite number >= 0 (nats for js and kl; 0 = lossless)"
        object.__setattr__(self, "threshold", check_range("threshold", self.threshold, 0.0, math.inf, allowed))
        check_choice("residual", self.residual, RESIDUALS)


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """D(p, q) per row of [R, V] -> [R]: ``js``, ``kl`` (KL(q || p), inf where q has mass p rules
    out) or ``tv``. Exactly 0 where the rows are equal."""
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(dim=-1)
    if kind == "kl":
        return (torch.xlogy(q, q) - torch.xlogy(q, p)).sum(dim=-1).clamp(min=0.0)
    middle = 0.5 * (p + q)
    terms = torch.xlogy(p, p) - torch.xlogy(p, middle) + torch.xlogy(q, q) - torch.xlogy(q, middle)
    return (0.5 * terms.sum(dim=-1)).clamp(min=0.0)


@register_verifier("fsd", params=FsdParams)
class FsdVerifier(ChainRule):
    __doc__ = __doc__
    params: FsdParams

    def row_rule(self, rows: ChainRows) -> RowRule:
        within = (divergence(rows.p, rows.q, self.params.divergence) <= self.params.threshold)[:, None]
        if self.params.residual == "target":
            return RowRule(torch.where(within, 1.0, torch.zeros_like(rows.p)), rows.p)
        strict = (rows.p / rows.q.clamp(min=TINY)).clamp(max=1.0)
        return RowRule(torch.where(within, 1.0, strict), (rows.p - rows.q).clamp(min=0.0))

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        self.greedy_rows(step, prep)
        keep_any = POINT_MASSES_APART[self.params.divergence] <= self.params.threshold
        return self.greedy_with(step, prep, torch.full_like(step.draft_tokens, keep_any, dtype=torch.bool))
