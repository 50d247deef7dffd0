"""The template of the lossy rules that judge chains only: accept a draft x with a(x), else draw
from a correction r (``top_m``, ``lenient``, ``cascade``, ``mentored``, ``tv_budget``).

A subclass gives, per drafted row, a(x) over the vocabulary and the unnormalised correction;
``verify`` and ``emission`` both read them, so the sampled verdicts and the exact P_V come from
one definition. A rule that moves the target to a distribution pi and then rejection-samples
toward it (a(x) = min(1, pi / q), r = norm(max(0, pi - q))) emits exactly pi: ``toward``.

The proposal q is the drafter's distribution per row (``draft_dists``), or one-hot at a
deterministic draft. The bonus row after a fully kept chain draws from p. Trees are refused:
their sibling walk would need each rule's multi-draft form, which none of the sources gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mars_bench.verification.base import Reason, Verdict, VerifyInput
from mars_bench.verification.emission import TINY, Emission, mix, normalised, proposal_rows
from mars_bench.verification.kernels import Prepared, RowDraws, finish, gather_at, on_rows, version_of
from mars_bench.verification.sampling import RandomStreams, scaled
from mars_bench.verification.strict import GreedyRule, TreeVerifier


@dataclass(frozen=True)
class ChainRows:
    """One chain step's D drafted rows: p [D, V] (processed target), q [D, V] (the proposal),
    the drafter's confidence [D] (its largest probability: max q with ``draft_dists``, else the
    drafted token's ``draft_probs``, else 1), and all N+1 rows of p for the bonus."""

    p: torch.Tensor
    q: torch.Tensor
    confidence: torch.Tensor
    all_p: torch.Tensor


@dataclass(frozen=True)
class RowRule:
    """a(x) [D, V] in [0, 1] and the correction's unnormalised weights [D, V]."""

    accept: torch.Tensor
    correction: torch.Tensor


def toward(target: torch.Tensor, proposal: torch.Tensor) -> RowRule:
    """Rejection sampling from q toward pi ([D, V] each): emits exactly pi."""
    return RowRule((target / proposal.clamp(min=TINY)).clamp(max=1.0), (target - proposal).clamp(min=0.0))


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) per row of [R, V] -> [R]."""
    return 0.5 * (p - q).abs().sum(dim=-1)


def unit_temperature_probs(processed: torch.Tensor) -> torch.Tensor:
    """softmax of processed logits at temperature 1: the confidences greedy rules compare."""
    weights = scaled(processed, 1.0).exp_()
    return weights / weights.sum(dim=-1, keepdim=True)


def same(first: object, second: object) -> bool:
    """Tensors are the same only as one object (no elementwise comparison); other values by equality."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return first is second
    return first == second


class ChainRule(TreeVerifier):
    """Base of the chain-only rules; subclasses implement ``row_rule`` and ``greedy_rule``."""

    lossless = False
    chains_only: ClassVar[bool] = True

    def row_rule(self, rows: ChainRows) -> RowRule:
        raise NotImplementedError

    def node_statistics(self, step: VerifyInput, prep: Prepared, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The declared statistics per draft ([N] each) from p at each draft's row ([N, V]: the processed p when
        sampling, the temperature-1 p when greedy); None for a rule that declares none."""
        return None

    def row_statistics(self, step: VerifyInput, prep: Prepared, p: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """``node_statistics`` at the rows judging the drafts (``kernels.finish``)."""
        found = self.node_statistics(step, prep, p)
        return None if found is None else {name: on_rows(values, prep.layout) for name, values in found.items()}

    def rule_for(self, step: VerifyInput, rows: ChainRows) -> RowRule:
        """``row_rule`` of this step, kept for the next call on the same target logits and proposal:
        ``verify`` and ``emission`` of one step, or many verdicts drawn from one step, solve the
        rule once (``mentored`` solves for its constants)."""
        logits = (step.target_logits, version_of(step.target_logits), step.sampling, step.drafts_per_row)
        if step.draft_dists is not None:  # the rule reads the proposal's distributions only
            key = (*logits, step.draft_dists)
        else:  # one-hot proposals at the drafts (the same tensor, unchanged: no host read), and draft_probs
            key = (*logits, step.draft_tokens, version_of(step.draft_tokens), step.draft_probs)
        cached = getattr(self, "_rule_cache", None)
        if cached is not None and len(cached[0]) == len(key) and all(map(same, cached[0], key)):
            return cached[1]
        rule = self.row_rule(rows)
        self._rule_cache = (key, rule)
        return rule

    def chain_rows(self, step: VerifyInput, prep: Prepared) -> ChainRows:
        if not prep.layout.chain:
            raise ValueError(f"verifier {self.name} judges chains only: got a tree of drafts (use a chain drafter)")
        probs = prep.probs
        proposal = proposal_rows(step.draft_tokens, step.draft_dists, probs.shape[-1])
        return ChainRows(prep.layout.drafted_rows(probs), proposal, self.confidence(step), probs)

    def confidence(self, step: VerifyInput) -> torch.Tensor:
        if step.draft_dists is not None:
            return step.draft_dists.float().max(dim=-1).values
        if step.draft_probs is not None:
            return step.draft_probs.float()
        return torch.ones(step.num_drafts, device=step.draft_tokens.device)

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        rows = self.chain_rows(step, prep)
        rule = self.rule_for(step, rows)
        drafts = step.draft_tokens
        keep = gather_at(rule.accept, drafts)
        strict = (gather_at(rows.p, drafts) / gather_at(rows.q, drafts).clamp(min=TINY)).clamp(max=1.0)
        uniforms = streams.node_uniforms(drafts.device)
        accepted = uniforms < keep
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(accepted, torch.where(uniforms < strict, int(Reason.SAMPLED), int(Reason.RELAXED)), rejected)
        weights = prep.layout.with_drafted_rows(rows.all_p, normalised(rule.correction, rows.p))
        return finish(accepted, reasons, RowDraws(weights, streams), prep, statistics=self.row_statistics(step, prep, rows.p))

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        rows = self.chain_rows(step, prep)
        rule = self.rule_for(step, rows)
        return mix(rows.q, rule.accept, normalised(rule.correction, rows.p), prep.layout.judging_rows)

    def greedy_with(self, step: VerifyInput, prep: Prepared, relaxed: torch.Tensor,
                    statistics: dict[str, torch.Tensor] | None = None) -> GreedyRule:  # fmt: skip
        """Greedy decisions: keep the target's argmax, and a draft where ``relaxed`` ([N]) holds; ``statistics``:
        the rule's declared ones per row (``row_statistics``)."""
        drafts = step.draft_tokens
        is_top1 = drafts == prep.nodes.t1
        accepted = is_top1 | relaxed
        rejected = torch.full_like(drafts, int(Reason.REJECTED))
        reasons = torch.where(is_top1, int(Reason.EXACT), torch.where(accepted, int(Reason.RELAXED), rejected))
        return GreedyRule(accepted, reasons, statistics=statistics)

    def greedy_rows(self, step: VerifyInput, prep: Prepared) -> torch.Tensor:
        """Greedy mode: refuse trees, and give the target's temperature-1 probabilities per node's row."""
        if not prep.layout.chain:
            raise ValueError(f"verifier {self.name} judges chains only: got a tree of drafts (use a chain drafter)")
        return prep.parent_rows(unit_temperature_probs(prep.processed))
