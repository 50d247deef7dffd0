"""The chain-verifier template and the lossless verifiers ``exact`` and ``rejection``."""

from __future__ import annotations

from dataclasses import replace

import torch

from mars_bench.verification.base import Reason, Verdict, Verifier, VerifyInput, register_verifier
from mars_bench.verification.kernels import Prepared, finish, input_problems, reasons_from, strict_rejection, top_two
from mars_bench.verification.sampling import probabilities, process_logits, sample_rows


class ChainVerifier(Verifier):
    """Validates the step, processes the target logits once, then dispatches on greedy vs sampling.

    Subclasses implement ``sampled``; ``greedy`` defaults to exact matching, which is what
    every shipped rule except ``mars`` does at temperature 0.
    """

    def verify(self, step: VerifyInput, *, generator: torch.Generator | None = None) -> Verdict:
        step.check()
        step.require_chain(self.name)
        problems = input_problems(step)
        # Out-of-range drafts are reported by ``finish``; clamping keeps the gathers before it valid.
        step = replace(step, draft_tokens=step.draft_tokens.clamp(0, step.target_logits.shape[-1] - 1))
        processed = process_logits(step.target_logits, step.sampling)  # [N+1, V]
        prep = Prepared(processed, top_two(processed[: step.num_drafts]), problems)
        if step.sampling.greedy:
            return self.greedy(step, prep)
        return self.sampled(step, prep, generator)

    def greedy(self, step: VerifyInput, prep: Prepared) -> Verdict:
        """Keep drafts equal to the argmax, emit the argmax after them."""
        choices = torch.argmax(prep.processed, dim=-1)
        accepted = step.draft_tokens == choices[: step.num_drafts]
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, prep)

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        raise NotImplementedError


@register_verifier("exact")
class ExactVerifier(ChainVerifier):
    """Keep the longest prefix of drafts equal to the target's own choices.

    Greedy: the target argmax at each position. Sampling: one target sample per position
    (from the processed distribution); drafts are kept while they equal those samples and
    the first sample that differs is emitted. Every emitted token is a target sample, so the
    rule is lossless in both modes (greedy up to numerics).
    """

    lossless = True

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        choices = sample_rows(probabilities(prep.processed, step.sampling), generator)
        accepted = step.draft_tokens == choices[: step.num_drafts]
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, prep)


@register_verifier("rejection")
class RejectionVerifier(ChainVerifier):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): lossless.

    Accept draft x with probability min(1, p(x) / q(x)); on the first reject emit a sample
    from norm(max(0, p - q)); after a fully accepted chain emit a sample from p. With no
    ``draft_dists`` the proposals are taken as deterministic (q one-hot). In greedy mode p is
    one-hot at the argmax, so the rule reduces to ``exact``.
    """

    lossless = True

    def sampled(self, step: VerifyInput, prep: Prepared, generator: torch.Generator | None) -> Verdict:
        strict = strict_rejection(probabilities(prep.processed, step.sampling), step.draft_tokens, step.draft_dists, generator)
        return finish(strict.accepted, reasons_from(strict.accepted, Reason.SAMPLED), strict.candidates, prep)
