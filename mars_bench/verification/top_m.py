"""``top_m``: keep a draft that is among the target's m most likely tokens; judge any other draft
by the strict rule (min(1, p / q), correction from the residual max(0, p - q)).

The top-k acceptance of blockwise parallel decoding (Stern, Shazeer and Uszkoreit, NeurIPS 2018)
and of SpecDec's top-beta verification (Xia et al., Findings of EMNLP 2023), here on top of
rejection sampling. Greedy: keep a draft among the top max(m, 1). m = 0 is ``rejection``
(``exact`` in greedy mode). Chains only. Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import VerifyInput, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule
from mars_bench.verification.kernels import Prepared
from mars_bench.verification.strict import GreedyRule


@dataclass(frozen=True)
class TopMParams:
    """Settings of ``top_m``: m, the number of the target's top tokens kept outright (0 = off)."""

    m: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 0:
            raise ValueError(f"m={self.m!r} is invalid: allowed is an integer >= 0 (0 = the strict rule)")


def top_mask(logits: torch.Tensor, m: int) -> torch.Tensor:
    """BoolTensor [R, V]: the m largest entries of each row (none for m = 0; filtered -inf never)."""
    mask = torch.zeros_like(logits, dtype=torch.bool)
    if m == 0:
        return mask
    top = torch.topk(logits, min(m, logits.shape[-1]), dim=-1)
    return mask.scatter_(-1, top.indices, top.values > float("-inf"))


@register_verifier("top_m", params=TopMParams)
class TopMVerifier(ChainRule):
    __doc__ = __doc__
    params: TopMParams

    def row_rule(self, rows: ChainRows) -> RowRule:
        strict = (rows.p / rows.q.clamp(min=1e-30)).clamp(max=1.0)
        log_p = torch.log(rows.p)  # the processed order: log is monotone, -inf where filtered
        return RowRule(torch.where(top_mask(log_p, self.params.m), 1.0, strict), (rows.p - rows.q).clamp(min=0.0))

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        self.greedy_rows(step, prep)
        in_top = top_mask(prep.processed, max(self.params.m, 1))[prep.layout.parent_rows, step.draft_tokens]
        return self.greedy_with(step, prep, in_top)
