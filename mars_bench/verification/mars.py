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
``never`` (default) never relaxes there; ``gap`` relaxes when z1 - z2 < (1 - theta) * |z1|;
``none`` has no guard (below).
Trees: the trigger is decided once per row (all children of a node share its logits) and
the children are tried in draft order; in greedy mode a child equal to t1 is taken before
a relaxed t2 child, as the paper's rule checks the exact match first.

Entropy gate (``entropy_gate=h``, off by default): relax only where the entropy of the target's
distribution exceeds h nats as well, the gate of FLy (arXiv 2511.22972); in greedy mode the
entropy of the temperature-1 distribution.

The ports of the rule (docs/verifiers.md) differ from the paper's by these settings:
``guard=none`` is SecureSD's test (``securesd/verifier/mars.py``): z2 / z1 > theta as written, in
float32, with no guard. Two negative logits then give a ratio >= 1, so z1 < 0 relaxes under any
theta < 1 (and theta = 1 relaxes wherever z2 < z1 < 0); at z1 = 0 the ratio is nan (z2 = 0:
no relaxation, as every comparison with nan is false), -inf (z1 = +0.0, z2 < 0: none) or +inf
(z1 = -0.0, z2 < 0: relaxes); a runner-up filtered to -inf under z1 < 0 gives +inf too.
``sampling=securesd`` is SecureSD's sampling behaviour: at T > 0 the greedy rule above decides
(the top token, or the runner-up where triggered, kept with no coin and whatever the drafter's
q; otherwise reject), and the target's top token is emitted both after a reject and after a fully
kept draft; it draws no random numbers. ``correction`` has nothing to choose then and must stay
``residual``. ``margin_logits=raw`` takes z1, z2 and the tokens t1, t2 from the raw logits
(before top-k and top-p) when sampling, as SecureSD, which has no top-k or top-p, does; the
target's p, and with it the strict test and every correction drawn from p, stays processed.
Without top-k and top-p the two are the same logits. SecureSD takes its top 2 with
``torch.topk`` and its correction with ``argmax``; this verifier takes ``kernels.top_two`` for
both, which differ from them only among tied logits. Its port is ``guard=none,
sampling=securesd, margin_logits=raw``; SecureSD judges chains only, this verifier trees too.

Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from mars_bench.common.settings import OPTIONAL
from mars_bench.verification.base import (
    COUNT,
    VALUE,
    Reason,
    Statistic,
    Verdict,
    VerifyInput,
    check_choice,
    check_range,
    check_theta,
    register_verifier,
)
from mars_bench.verification.emission import Emission, greedy_emission, mix
from mars_bench.verification.kernels import Prepared, RowDraws, TopTwo, finish, strict_rejection, top_two
from mars_bench.verification.sampling import RandomStreams, SamplingParams, probabilities
from mars_bench.verification.strict import (
    GreedyRule,
    TreeVerifier,
    accept_then_correct,
    strict_accept,
    strict_correction,
    top2_mask,
)

GUARDS = ("never", "gap", "none")
CORRECTIONS = ("residual", "target")
SAMPLINGS = ("paper", "securesd")
MARGIN_LOGITS = ("processed", "raw")


@dataclass(frozen=True)
class MarsParams:
    """Settings of ``mars``.

    theta: the ratio threshold in (0, 1]; None turns relaxation off.
    guard: what happens where z1 <= 0: ``never`` relax, use the ``gap`` form, or ``none``: the
        ratio as written (SecureSD's port; two negative logits pass any theta < 1).
    correction: what a reject at a triggered position emits: a sample from the ``residual``
        or from the ``target`` distribution p.
    sampling: the rule at T > 0: the ``paper``'s (the strict test where untriggered, corrections
        sampled), or ``securesd``'s (the greedy rule at every temperature, the argmax emitted).
    margin_logits: where z1, z2, t1, t2 come from when sampling: the ``processed`` logits (after
        top-k and top-p) or the ``raw`` ones (SecureSD's port).
    entropy_gate: relax only where the target's entropy exceeds this many nats (None: no gate).

    ``sampling``, ``margin_logits`` and ``entropy_gate`` came later: labels carry them only when set.
    """

    theta: float | None = 0.9
    guard: str = "never"
    correction: str = "residual"
    sampling: str = field(default="paper", metadata=OPTIONAL)
    margin_logits: str = field(default="processed", metadata=OPTIONAL)
    entropy_gate: float | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        object.__setattr__(self, "theta", check_theta(self.theta))
        if self.entropy_gate is not None:
            allowed = "a number >= 0 (nats), or null for no gate"
            object.__setattr__(self, "entropy_gate", check_range("entropy_gate", self.entropy_gate, 0.0, math.inf, allowed))
        check_choice("guard", self.guard, GUARDS)
        check_choice("correction", self.correction, CORRECTIONS)
        check_choice("sampling", self.sampling, SAMPLINGS)
        check_choice("margin_logits", self.margin_logits, MARGIN_LOGITS)
        if self.sampling == "securesd" and self.correction != "residual":
            raise ValueError(
                f"correction={self.correction!r} is invalid with sampling='securesd', which emits the target's "
                "argmax after a reject: allowed is residual (the default, unused there)"
            )


def margin_trigger(z1: torch.Tensor, z2: torch.Tensor, theta: float | None, guard: str) -> torch.Tensor:
    """BoolTensor[R]: where the margin rule relaxes, from the top-1 and runner-up logits [R].

    ``none`` divides as SecureSD does, in the logits' float32: a nan ratio (0 / 0) never relaxes,
    an infinite one (z1 = -0.0 or a runner-up at -inf under z1 < 0) relaxes when it is +inf."""
    if theta is None:
        return torch.zeros_like(z1, dtype=torch.bool)
    if guard == "gap":
        return (z1 - z2) < (1.0 - theta) * z1.abs()
    if guard == "none":
        return (z2 / z1) > theta
    return (z1 > 0) & (z2 > theta * z1)


MARGIN_STATISTICS = (  # what the margin rules (mars, mars_ref) report at every visited depth
    Statistic("margin", VALUE, "z2 / z1: the runner-up's target logit over the top one's, as the rule read them "
              "(inf or nan where z1 = 0)"),  # fmt: skip
    Statistic("trigger", COUNT, "the rule's relaxation trigger fired (the margin over theta, as its guard and gate decide)"),
    Statistic("nonpositive_top1", COUNT, "z1 <= 0: the top logit is not positive, where the guard decides"),
)


def margin_statistics(rows: TopTwo, trigger: torch.Tensor) -> dict[str, torch.Tensor]:
    """``MARGIN_STATISTICS`` per row ([N+1] each) from the rows' top two logits and the rule's ``trigger``."""
    return {"margin": rows.z2 / rows.z1, "trigger": trigger, "nonpositive_top1": rows.z1 <= 0}


@register_verifier("mars", params=MarsParams)
class MarsVerifier(TreeVerifier):
    __doc__ = __doc__
    lossless = False
    statistics: ClassVar[tuple[Statistic, ...]] = MARGIN_STATISTICS
    params: MarsParams

    def prepare(self, step: VerifyInput) -> tuple[VerifyInput, Prepared]:
        """The common start; with ``margin_logits=raw`` and top-k or top-p on, the top 2 of every row
        and node from the raw logits (otherwise the processed logits are the raw ones)."""
        step, prep = super().prepare(step)
        sampling = step.sampling
        if self.params.margin_logits == "raw" and not sampling.greedy and (sampling.top_k > 0 or sampling.top_p < 1):
            rows = top_two(step.target_logits.float())
            prep = replace(prep, rows=rows, nodes=rows.at(prep.layout.parent_rows))
        return step, prep

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
        return GreedyRule(accepted, reasons, preferred=is_top1, statistics=margin_statistics(prep.rows, row_trigger))

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        if self.params.sampling == "securesd":
            return self.greedy(step, prep)  # no coin, no draw: the argmax after the kept drafts
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
        return finish(accepted, reasons, candidates, prep, statistics=margin_statistics(prep.rows, row_trigger))

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """The strict rule's P_V with a(x) = 1 for x in the top 2 of a triggered row, and the
        correction p there when ``correction="target"``; ``sampling="securesd"``: see ``securesd_emission``."""
        if self.params.sampling == "securesd":
            return self.securesd_emission(step, prep)
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

    def securesd_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """P_V of ``sampling="securesd"`` at T > 0, the greedy rule's: with deterministic drafts a point
        mass per row, at the child the walk takes, else at t1; with ``draft_dists`` (chains) the drafts
        are q's samples, so P_V = (1 - g q(t2)) 1{t1} + g q(t2) 1{t2}, g = 1 where the row is triggered
        (and t2 != t1), else 0; alpha_V = q(t1) + g q(t2)."""
        rule = self.greedy_rule(step, prep)
        layout, vocab = prep.layout, prep.processed.shape[-1]
        if step.draft_dists is None:
            return greedy_emission(rule.accepted, step.draft_tokens, prep.rows.t1, layout, vocab, rule.preferred)
        top1 = torch.zeros(layout.parent_rows.shape[0], vocab, device=prep.processed.device)
        top1.scatter_(-1, layout.drafted_rows(prep.rows.t1)[:, None], 1.0)
        relaxed = layout.drafted_rows(rule.statistics["trigger"])[:, None] & top2_mask(prep)
        accept = torch.where(relaxed, 1.0, top1)
        return mix(step.draft_dists.float(), accept, top1, layout.judging_rows)
