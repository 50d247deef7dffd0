"""The verifier template (chains and trees) and the lossless verifiers ``exact`` and ``rejection``."""

from __future__ import annotations

from dataclasses import replace

import torch

from mars_bench.verification.base import Reason, Verdict, Verifier, VerifyInput, register_verifier
from mars_bench.verification.kernels import Prepared, finish, input_problems, reasons_from, strict_rejection, top_two, tree_layout
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits, sample_rows


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

    def verify(self, step: VerifyInput, *, generator: torch.Generator | None = None) -> Verdict:
        step.check()
        layout = tree_layout(tuple(step.parents.tolist()), str(step.target_logits.device))
        if step.draft_dists is not None and not layout.chain:
            raise ValueError(
                "draft_dists with a tree of drafts is not supported: tree drafters propose deterministically (draft_dists=None)"
            )
        problems = input_problems(step, layout)
        # Out-of-range drafts are reported by ``finish``; clamping keeps the gathers before it valid.
        step = replace(step, draft_tokens=step.draft_tokens.clamp(0, step.target_logits.shape[-1] - 1))
        processed = self.process(step.target_logits, step.sampling)  # [N+1, V]
        rows = top_two(processed)
        prep = Prepared(processed, rows, rows.at(layout.parent_rows), layout, problems)
        if step.sampling.greedy:
            return self.greedy(step, prep)
        return self.sampled(step, prep, generator)

    def greedy(self, step: VerifyInput, prep: Prepared) -> Verdict:
        """Keep drafts equal to the target's top token, emit the top token after them (no relaxation,
        so a verifier with a trigger reports it fired nowhere)."""
        choices = prep.rows.t1
        accepted = step.draft_tokens == prep.nodes.t1
        no_trigger = torch.zeros_like(choices, dtype=torch.bool) if self.has_trigger else None
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, prep, row_trigger=no_trigger)

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
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

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        choices = sample_rows(probabilities(prep.processed, step.sampling), generator)
        accepted = step.draft_tokens == prep.parent_rows(choices)
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, prep)


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

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        probs = probabilities(prep.processed, step.sampling)
        strict = strict_rejection(probs, step.draft_tokens, step.draft_dists, prep.layout, generator)
        return finish(strict.accepted, reasons_from(strict.accepted, Reason.SAMPLED), strict.candidates, prep)
