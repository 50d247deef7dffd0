"""``bild``: the rollback policy of the Big Little Decoder (Kim et al., "Speculative Decoding with Big
Little Decoder", NeurIPS 2023, arXiv 2302.07863; SecureSD's ``securesd/verifier/bild.py``).

Greedy, as BiLD defines it: reject a draft x iff -log p(x) > r (``rollback``, nats) and x is not the
target's argmax, p the target's temperature-1 distribution, and emit the argmax after a reject.

Sampling (BiLD defines the rollback for greedy decoding only; the choice here): keep a draft the
target finds plausible, -log p(x) <= r, outright, and judge any other by the strict rule (min(1,
p / q), then a sample from norm(max(0, p - q))), p the target's processed distribution. The greedy
rule is this rule at temperature 0, where the strict rule keeps exactly the argmax. SecureSD keeps
drafts deterministically when sampling too and emits the target's argmax after every reject and
after a fully kept chain; its per-step rule stops at the first position over r only when that draft
is not the argmax. BiLD's fallback policy (the drafter hands over when its own confidence is low)
decides how far to draft, not what to keep, and is not part of this verifier.

r = 0 is ``rejection`` (``exact`` in greedy mode); larger r keeps more. Chains only. Not lossless.

Statistic: ``rollback``, where BiLD's rollback test fired (-log p(x) > r and x is not the argmax): a reject in
greedy mode; when sampling, the strict rule then judges the draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from mars_bench.verification.base import COUNT, Statistic, VerifyInput, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule
from mars_bench.verification.emission import TINY
from mars_bench.verification.kernels import Prepared, gather_at
from mars_bench.verification.strict import GreedyRule


@dataclass(frozen=True)
class BildParams:
    """Settings of ``bild``: rollback, the threshold r >= 0 on -log p(x) in nats (0 = the strict rule)."""

    rollback: float = 8.0

    def __post_init__(self) -> None:
        allowed = "a finite number >= 0 (nats; 0 = the strict rule)"
        object.__setattr__(self, "rollback", check_range("rollback", self.rollback, 0.0, math.inf, allowed))


@register_verifier("bild", params=BildParams)
class BildVerifier(ChainRule):
    __doc__ = __doc__
    statistics: ClassVar[tuple[Statistic, ...]] = (
        Statistic("rollback", COUNT, "the rollback test fired: -log p(x) > rollback (nats) and x is not the target's argmax"),
    )
    params: BildParams

    def plausible(self, probs: torch.Tensor) -> torch.Tensor:
        """BoolTensor of ``probs``' shape: -log p <= r (never where p = 0)."""
        return torch.log(probs) >= -self.params.rollback

    def row_rule(self, rows: ChainRows) -> RowRule:
        strict = (rows.p / rows.q.clamp(min=TINY)).clamp(max=1.0)
        return RowRule(torch.where(self.plausible(rows.p), 1.0, strict), (rows.p - rows.q).clamp(min=0.0))

    def node_statistics(self, step: VerifyInput, prep: Prepared, p: torch.Tensor) -> dict[str, torch.Tensor]:
        implausible = ~self.plausible(gather_at(p, step.draft_tokens))
        return {"rollback": implausible & (step.draft_tokens != prep.nodes.t1)}

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        p1 = self.greedy_rows(step, prep)
        plausible = self.plausible(gather_at(p1, step.draft_tokens))
        return self.greedy_with(step, prep, plausible, self.row_statistics(step, prep, p1))
