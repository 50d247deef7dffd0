"""MARS margin-aware verification (arXiv 2601.15498), the paper's rule with explicit choices.

At a drafted position let z1 >= z2 be the two largest *processed* target logits (after
temperature, top-k and top-p, as the paper's code measures them), with tokens t1, t2 (t1
the first index of the maximum, as ``torch.argmax``; see ``kernels.top_two``).
Relaxation triggers when the ratio z2 / z1 exceeds ``theta`` (a test of the logit gap
relative to the top logit: z1 - z2 < (1 - theta) * z1 when z1 > 0). Because a temperature
divides every logit, the trigger does not depend on the temperature.

Greedy: accept t1; accept t2 when triggered; otherwise reject and emit t1.
Sampling: when triggered, accept a draft in {t1, t2} outright; otherwise apply the strict
rejection-sampling test min(1, p/q). After a reject at an untriggered position emit a
sample from the residual norm(max(0, p - q)), as the strict rule does; after a reject at a
triggered position (the draft was outside the top 2 and failed the strict test) emit a
sample from that residual (``correction="residual"``) or from p (``correction="target"``).
With ``theta=None`` relaxation is off and the rule is exactly ``exact`` (greedy) or
``rejection`` (sampling), consuming the same random numbers.

Guard for z1 <= 0, where the ratio misbehaves (both logits negative give a ratio >= 1):
``never`` (default) never relaxes there; ``gap`` relaxes when z1 - z2 < (1 - theta) * |z1|.
Trees: the trigger is decided once per row (all children of a node share its logits) and
the children are tried in draft order; in greedy mode a child equal to t1 is taken before
a relaxed t2 child, as the paper's rule checks the exact match first.

Entropy gate (``entropy_gate=h``, off by default): relax only where the entropy of the target's
distribution exceeds h nats as well, the gate of FLy (arXiv 2511.22972); in greedy mode the
entropy of the temperature-1 distribution.

Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from mars_bench.common.settings import OPTIONAL
from mars_bench.verification.base import (
    Reason,
    Verdict,
    VerifyInput,
    check_choice,
    check_range,
    check_theta,
    register_verifier,
)
from mars_bench.verification.emission import Emission
from mars_bench.verification.kernels import Prepared, RowDraws, finish, strict_rejection
from mars_bench.verification.sampling import RandomStreams, SamplingParams, probabilities
from mars_bench.verification.strict import (
    GreedyRule,
    TreeVerifier,
    accept_then_correct,
    strict_accept,
    strict_correction,
    top2_mask,
)

GUARDS = ("never", "gap")
CORRECTIONS = ("residual", "target")


@dataclass(frozen=True)
class MarsParams:
    """Settings of ``mars``.

    theta: the ratio threshold in (0, 1]; None turns relaxation off.
    guard: what happens where z1 <= 0: ``never`` relax, or use the ``gap`` form.
    correction: what a reject at a triggered position emits: a sample from the ``residual``
        or from the ``target`` distribution p.
    entropy_gate: relax only where the target's entropy exceeds this many nats (None: no gate).
    """

    theta: float | None = 0.9
    guard: str = "never"
    correction: str = "residual"
    entropy_gate: float | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_theta(self.theta))
        if self.entropy_gate is not None:
            allowed = "a number >= 0 (nats), or null for no gate"
            object.__setattr__(self, "entropy_gate", check_range("entropy_gate", self.entropy_gate, 0.0, math.inf, allowed))
        check_choice("guard", self.guard, GUARDS)
        check_choice("correction", self.correction, CORRECTIONS)


def margin_trigger(z1: torch.Tensor, z2: torch.Tensor, theta: float | None, guard: str) -> torch.Tensor:
    """BoolTensor[R]: where the margin rule relaxes, from the top-1 and runner-up logits [R]."""
    if theta is None:
        return torch.zeros_like(z1, dtype=torch.bool)
    if guard == "gap":
        return (z1 - z2) < (1.0 - theta) * z1.abs()
    return (z1 > 0) & (z2 > theta * z1)


@register_verifier("mars", params=MarsParams)
class MarsVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    has_trigger: ClassVar[bool] = True
    params: MarsParams

    def row_trigger(self, prep: Prepared, sampling: SamplingParams) -> torch.Tensor:
        """BoolTensor[N+1]: where the margin rule (and the entropy gate, if set) relaxes, per row."""
        trigger = margin_trigger(prep.rows.z1, prep.rows.z2, self.params.theta, self.params.guard)
        if self.params.entropy_gate is None:
            return trigger
        unit = SamplingParams(1.0) if sampling.greedy else sampling
        probs = probabilities(prep.processed, unit)
        entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(dim=-1)
        return trigger & (entropy > self.params.entropy_gate)

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        top, drafts = prep.nodes, step.draft_tokens
        row_trigger = self.row_trigger(prep, step.sampling)
        is_top1, is_top2 = drafts == top.t1, (drafts == top.t2) & (top.t2 != top.t1)
        relaxed = prep.parent_rows(row_trigger) & is_top2
        accepted = is_top1 | relaxed
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(is_top1, int(Reason.EXACT), torch.where(relaxed, int(Reason.RELAXED), rejected))
        return GreedyRule(accepted, reasons, preferred=is_top1, row_trigger=row_trigger)

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        top, drafts = prep.nodes, step.draft_tokens
        row_trigger = self.row_trigger(prep, step.sampling)
        in_top2 = (drafts == top.t1) | (drafts == top.t2)
        probs = prep.probs
        strict = strict_rejection(probs, drafts, step.draft_dists, prep.layout, streams)
        relaxed = prep.parent_rows(row_trigger) & in_top2 & ~strict.accepted
        accepted = strict.accepted | relaxed
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(strict.accepted, int(Reason.SAMPLED), torch.where(relaxed, int(Reason.RELAXED), rejected))
        candidates = strict.candidates
        if self.params.correction == "target" and self.params.theta is not None:
            # A row with no children has the residual p anyway, so its bonus is unchanged.
            candidates = RowDraws(torch.where(row_trigger[:, None], probs, candidates.weights), streams)
        return finish(accepted, reasons, candidates, prep, row_trigger=row_trigger)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """The strict rule's P_V with a(x) = 1 for x in the top 2 of a triggered row, and the
        correction p there when ``correction="target"``."""
        row_trigger = self.row_trigger(prep, step.sampling)
        probs = prep.probs
        accept = strict_accept(step, prep)
        if step.draft_dists is None:
            top, drafts = prep.nodes, step.draft_tokens
            relaxed = prep.parent_rows(row_trigger) & ((drafts == top.t1) | (drafts == top.t2))
        else:
            relaxed = prep.layout.drafted_rows(row_trigger)[:, None] & top2_mask(prep)
        correction = strict_correction(step, prep)
        if self.params.correction == "target" and self.params.theta is not None:
            correction = torch.where(row_trigger[:, None], probs, correction)
        return accept_then_correct(step, prep, torch.where(relaxed, 1.0, accept), correction)
