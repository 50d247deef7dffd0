"""``lossy_sd``: the eps-additive relaxation of the strict rule (SecureSD's ``lossy_sd``,
``securesd/verifier/common.py`` in YichiCS/Secure-Speculative-Decoding).

Keep a draft x with probability min(1, p(x) / q(x) + eps); after a reject emit a sample from the
strict residual norm(max(0, p - q)), not adjusted for eps. q is the drafter's distribution, one-hot
at a deterministic draft (there a draft is kept with min(1, p(x) + eps)).

Greedy: keep x with probability min(1, 1[x = argmax] + eps), and emit the argmax after a reject.
This greedy form is itself random: its coin is one float32 uniform per drafted node from the
request's own stream (the generator the engine passes in both modes), drawn as the sampling rules
draw theirs, so a greedy run is reproducible from its seed; at eps = 0 no coin is drawn. Its P_V
is then no point mass: eps on a kept non-argmax draft, 1 - eps on the argmax.

eps = 0 is ``rejection`` (``exact`` in greedy mode), verdicts and draws included. Chains only.
Not lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.verification.base import Verdict, VerifyInput, check_range, register_verifier
from mars_bench.verification.chain_rule import ChainRows, ChainRule, RowRule
from mars_bench.verification.emission import TINY, Emission, sequential
from mars_bench.verification.kernels import Prepared, finish, raise_on_problems
from mars_bench.verification.sampling import Generators, RandomStreams
from mars_bench.verification.strict import GreedyRule


@dataclass(frozen=True)
class LossySdParams:
    """Settings of ``lossy_sd``: eps, added to the strict acceptance ratio, in [0, 1] (0 = the strict rule)."""

    eps: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_range("eps", self.eps, 0.0, 1.0, "a number in [0, 1] (0 = the strict rule)"))


@register_verifier("lossy_sd", params=LossySdParams)
class LossySdVerifier(ChainRule):
    __doc__ = __doc__
    params: LossySdParams

    @property
    def greedy_draws(self) -> bool:
        """Whether greedy verdicts draw a coin (eps > 0), so that greedy P_V is no point mass."""
        return self.params.eps > 0

    def row_rule(self, rows: ChainRows) -> RowRule:
        ratio = rows.p / rows.q.clamp(min=TINY)
        return RowRule((ratio + self.params.eps).clamp(max=1.0), (rows.p - rows.q).clamp(min=0.0))

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        """The argmax only: the eps coin is drawn in ``verify_batch``, which has the streams."""
        self.greedy_rows(step, prep)
        return super().greedy_rule(step, prep)

    def verify_batch(self, step: VerifyInput, *, generator: Generators = None) -> list[Verdict]:
        if not (self.greedy_draws and step.sampling.greedy):
            return super().verify_batch(step, generator=generator)
        step, prep = self.prepare(step)
        self.greedy_rows(step, prep)
        coins = RandomStreams.of(generator, prep.layout.drafts_per_row).node_uniforms(step.draft_tokens.device)
        rule = self.greedy_with(step, prep, coins < self.params.eps)
        return finish(rule.accepted, rule.reasons, prep.rows.t1, prep)

    def joint_emission(self, step: VerifyInput) -> Emission:
        if not (self.greedy_draws and step.sampling.greedy):
            return super().joint_emission(step)
        step, prep = self.prepare(step)
        raise_on_problems(prep.problems.tolist())
        self.greedy_rows(step, prep)
        keep = torch.where(step.draft_tokens == prep.nodes.t1, 1.0, self.params.eps)
        return sequential(keep, step.draft_tokens, prep.probs, prep.layout)  # greedy p: one-hot at each row's argmax
