"""``lenient``: the lenience rule of Leviathan, Kalman and Matias (ICML 2023, appendix A.5): keep
a draft x with probability min(1, p(x) / (l q(x))), so no token is emitted with probability
above p(x) / l. The appendix leaves the correction open; here it is the strict residual
norm(max(0, p - q)), as the speculative cascades authors' code does.

Greedy (the appendix's temperature-0 form): keep x when p1(x) >= l max p1, p1 the target's
temperature-1 probabilities. l = 1 is ``rejection`` (``exact`` in greedy mode). Chains only.
Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_bench.verification.base import VerifyInput, check_unit_interval, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule


@dataclass(frozen=True)
class LenientParams:
    """Settings of ``lenient``: lenience, the factor l in (0, 1] on q (1 = the strict rule)."""

    lenience: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "lenience", check_unit_interval("lenience", self.lenience))


@register_verifier("lenient", params=LenientParams)
class LenientVerifier(ChainRule):
    __doc__ = __doc__
    params: LenientParams

    def row_rule(self, rows: ChainRows) -> RowRule:
        accept = (rows.p / (self.params.lenience * rows.q).clamp(min=1e-30)).clamp(max=1.0)
        return RowRule(accept, (rows.p - rows.q).clamp(min=0.0))

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        p1 = self.greedy_rows(step, prep)
        p_draft = p1.gather(-1, step.draft_tokens[:, None]).squeeze(-1)
        lenient = (p_draft >= self.params.lenience * p1.max(dim=-1).values) & (self.params.lenience < 1)
        return self.greedy_with(step, prep, lenient)
