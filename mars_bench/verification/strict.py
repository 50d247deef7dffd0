"""The verifier template (chains and trees) and the lossless verifiers ``exact`` and ``rejection``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mars_bench.verification.base import Reason, Verdict, Verifier, VerifyInput, register_verifier
from mars_bench.verification.emission import TINY, Emission, greedy_emission, mix, normalised, sequential, split_emission
from mars_bench.verification.kernels import (
    Prepared,
    at_nodes,
    finish,
    input_problems,
    raise_on_problems,
    reasons_from,
    residual_rows,
    sibling_normalisers,
    strict_rejection,
    target_view,
    tree_layout,
)
from mars_bench.verification.sampling import Generators, RandomStreams, SamplingParams, process_logits


@dataclass(frozen=True)
class GreedyRule:
    """A greedy rule's decisions: accepted and reasons per node ([N]), the nodes a row's walk takes
    before their other accepted siblings (``preferred``, or None: draft order) and the rule's declared
    statistics per row ([N+1] each, ``kernels.finish``; None: it declares none)."""

    accepted: torch.Tensor
    reasons: torch.Tensor
    preferred: torch.Tensor | None = None
    statistics: dict[str, torch.Tensor] | None = None


def strict_accept(step: VerifyInput, prep: Prepared) -> torch.Tensor:
    """The strict rule's acceptance probability min(1, p / q): per node ([N]) for deterministic
    drafts (q one-hot; a tree's sibling is judged on p without the earlier siblings' tokens), per
    token ([D, V]) for a chain with ``draft_dists``."""
    probs = prep.probs
    if step.draft_dists is None:
        p_node = at_nodes(probs, step.draft_tokens, prep.layout)
        mass = sibling_normalisers(p_node, torch.ones_like(p_node), prep.layout)
        return (p_node / mass.clamp(min=torch.finfo(mass.dtype).tiny)).clamp(max=1.0)
    return (prep.layout.drafted_rows(probs) / step.draft_dists.float().clamp(min=TINY)).clamp(max=1.0)


def strict_correction(step: VerifyInput, prep: Prepared) -> torch.Tensor:
    """FloatTensor[N+1, V]: the strict rule's normalised correction per row (its residual)."""
    return normalised(residual_rows(prep.probs, step.draft_tokens, step.draft_dists, prep.layout), prep.probs)


def top2_mask(prep: Prepared) -> torch.Tensor:
    """BoolTensor[D, V]: the target's top-2 tokens at the rows judging a chain's D drafts."""
    layout, rows = prep.layout, prep.rows
    t1, t2 = layout.drafted_rows(rows.t1), layout.drafted_rows(rows.t2)
    mask = torch.zeros(t1.shape[0], prep.processed.shape[-1], dtype=torch.bool, device=prep.processed.device)
    mask.scatter_(-1, t1[:, None], True)
    return mask.scatter_(-1, t2[:, None], True)


def accept_then_correct(step: VerifyInput, prep: Prepared, accept: torch.Tensor, correction: torch.Tensor) -> Emission:
    """P_V of a rule that keeps a draft with probability ``accept`` (per node [N] for deterministic
    drafts, per token [D, V] with ``draft_dists``) and otherwise draws from ``correction`` [N+1, V]."""
    if step.draft_dists is None:
        return sequential(accept, step.draft_tokens, correction, prep.layout)
    return mix(step.draft_dists.float(), accept, prep.layout.drafted_rows(correction), prep.layout.judging_rows)


class TreeVerifier(Verifier):
    """Validates the step, processes the target logits once, then dispatches on greedy vs sampling.

    Subclasses implement ``sampled``; ``greedy`` defaults to exact matching, which is what
    every shipped rule except ``mars`` does at temperature 0. Both see chains and trees
    alike (see ``kernels.py``). ``process`` is the logits processing the verifier applies
    (a subclass reproducing other code may choose another).
    """

    def process(self, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """Processed float32 logits [..., V] from raw ``logits`` [..., V]: top-k, then top-p."""
        return process_logits(logits, sampling)

    def prepare(self, step: VerifyInput) -> tuple[VerifyInput, Prepared]:
        """Check the step and process its logits once: the common start of ``verify`` and ``emission``."""
        step.check()
        layout = tree_layout(tuple(step.parents.tolist()), str(step.target_logits.device), step.drafts_per_row)
        if step.draft_dists is not None and not layout.chain:
            raise ValueError(
                "draft_dists with a tree of drafts is not supported: tree drafters propose deterministically (draft_dists=None)"
            )
        view = target_view(step.target_logits, step.sampling, self.process, type(self).process)
        problems = input_problems(step, layout, view.raw_max)
        # Out-of-range drafts are reported by ``finish``; clamping keeps the gathers before it valid.
        step = replace(step, draft_tokens=step.draft_tokens.clamp(0, step.target_logits.shape[-1] - 1))
        rows = view.rows
        return step, Prepared(view.processed, rows, rows.at(layout.parent_rows), layout, problems, view, step.draft_tokens)

    def verify_batch(self, step: VerifyInput, *, generator: Generators = None) -> list[Verdict]:
        step, prep = self.prepare(step)
        if step.sampling.greedy:
            return self.greedy(step, prep)
        return self.sampled(step, prep, RandomStreams.of(generator, prep.layout.drafts_per_row))

    def emission(self, step: VerifyInput) -> Emission:
        """The exact distribution P_V of the token emitted at every row that judges drafts, and the
        probability alpha_V that a draft is kept there (see ``emission.py``), under this rule and its
        settings. A row is judged as if the walk reached it. Raises ValueError on invalid input."""
        if step.batch_size != 1:
            raise ValueError(f"emission states one request's step, got {step.batch_size}: a batched step goes to emission_batch")
        return self.joint_emission(step)

    def emission_batch(self, step: VerifyInput) -> list[Emission]:
        """``emission`` of each request of a batched step, in the request's own rows."""
        layout = tree_layout(tuple(step.parents.tolist()), str(step.target_logits.device), step.drafts_per_row)
        return split_emission(self.joint_emission(step), layout)

    def joint_emission(self, step: VerifyInput) -> Emission:
        """``emission`` of a step of one or B requests, over the batch's rows."""
        step, prep = self.prepare(step)
        raise_on_problems(prep.problems.tolist())
        if step.sampling.greedy:
            rule = self.greedy_rule(step, prep)
            vocab = prep.processed.shape[-1]
            return greedy_emission(rule.accepted, step.draft_tokens, prep.rows.t1, prep.layout, vocab, rule.preferred)
        return self.sampled_emission(step, prep)

    def greedy_rule(self, step: VerifyInput, prep: Prepared) -> GreedyRule:
        """Keep drafts equal to the target's top token (no relaxation). Every greedy rule emits the top token
        after its last kept draft. A verifier that declares statistics and keeps this rule overrides it to add them."""
        accepted = step.draft_tokens == prep.nodes.t1
        return GreedyRule(accepted, reasons_from(accepted, Reason.EXACT))

    def greedy(self, step: VerifyInput, prep: Prepared) -> list[Verdict]:
        rule = self.greedy_rule(step, prep)
        return finish(rule.accepted, rule.reasons, prep.rows.t1, prep, preferred=rule.preferred, statistics=rule.statistics)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        raise NotImplementedError(f"verifier {self.name} has no exact emission distribution in sampling mode")

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        raise NotImplementedError


@register_verifier("exact")
class ExactVerifier(TreeVerifier):
    """Keep the longest prefix of drafts equal to the target's own choices.

    Greedy: the target argmax at each position. Sampling: one target sample per position
    (from the processed distribution); drafts are kept while they equal those samples and
    the first sample that differs is emitted. In a tree the walk follows the child equal to
    the argmax (or sample) of its row. Every emitted token is a target sample, so the
    rule is lossless in both modes (greedy up to numerics).
    """

    lossless = True

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        choices = streams.sample(prep.probs, prep.layout.rows_per_request)
        accepted = step.draft_tokens == prep.parent_rows(choices)
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, prep)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        """A draft is kept when the target's sample equals it, so a rejected x leaves p without x:
        with deterministic drafts that is the strict rule with q one-hot; with ``draft_dists`` the
        rejections of every x add up to p(y) (1 - q(y))."""
        probs = prep.probs
        if step.draft_dists is None:
            return accept_then_correct(step, prep, strict_accept(step, prep), strict_correction(step, prep))
        proposal, drafted = step.draft_dists.float(), prep.layout.drafted_rows(probs)
        kept = proposal * drafted
        return Emission(kept + drafted * (1.0 - proposal), kept.sum(-1), prep.layout.judging_rows)


@register_verifier("rejection")
class RejectionVerifier(TreeVerifier):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): lossless.

    Accept draft x with probability min(1, p(x) / q(x)); on the first reject emit a sample
    from norm(max(0, p - q)); after a fully accepted chain emit a sample from p. With no
    ``draft_dists`` the proposals are taken as deterministic (q one-hot). Trees: recursive
    multi-draft rejection (SpecInfer): siblings are tried in draft order, each on p
    renormalised without the earlier siblings' tokens. In greedy mode p is one-hot at the
    argmax, so the rule reduces to ``exact``.
    """

    lossless = True

    def sampled(self, step: VerifyInput, prep: Prepared, streams: RandomStreams) -> list[Verdict]:
        strict = strict_rejection(prep.probs, step.draft_tokens, step.draft_dists, prep.layout, streams)
        return finish(strict.accepted, reasons_from(strict.accepted, Reason.SAMPLED), strict.candidates, prep)

    def sampled_emission(self, step: VerifyInput, prep: Prepared) -> Emission:
        return accept_then_correct(step, prep, strict_accept(step, prep), strict_correction(step, prep))
