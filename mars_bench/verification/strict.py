"""The chain-verifier template and the lossless verifiers ``exact`` and ``rejection``."""

from __future__ import annotations

import torch

from mars_bench.verification.base import Reason, Verdict, Verifier, VerifyInput, register_verifier
from mars_bench.verification.kernels import TopTwo, finish, reasons_from, strict_rejection, top_two
from mars_bench.verification.sampling import probabilities, process_logits, sample_rows


class ChainVerifier(Verifier):
    """Validates the step, processes the target logits once, then dispatches on greedy vs sampling.

    Subclasses implement ``sampled``; ``greedy`` defaults to exact matching, which is what
    every shipped rule except ``mars`` does at temperature 0.
    """

    def verify(self, step: VerifyInput, *, generator: torch.Generator | None = None) -> Verdict:
        step.check()
        step.require_chain(self.name)
        processed = process_logits(step.target_logits, step.sampling)  # [N+1, V]
        top = top_two(processed[: step.num_drafts])
        if step.sampling.greedy:
            return self.greedy(step, processed, top)
        return self.sampled(step, processed, top, generator)

    def greedy(self, step: VerifyInput, processed: torch.Tensor, top: TopTwo) -> Verdict:
        """Keep drafts equal to the argmax, emit the argmax after them."""
        choices = torch.argmax(processed, dim=-1)
        accepted = step.draft_tokens == choices[: step.num_drafts]
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, top)

    def sampled(self, step: VerifyInput, processed: torch.Tensor, top: TopTwo, generator: torch.Generator | None) -> Verdict:
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

    def sampled(self, step: VerifyInput, processed: torch.Tensor, top: TopTwo, generator: torch.Generator | None) -> Verdict:
        choices = sample_rows(probabilities(processed), generator)
        accepted = step.draft_tokens == choices[: step.num_drafts]
        return finish(accepted, reasons_from(accepted, Reason.EXACT), choices, top)


@register_verifier("rejection")
class RejectionVerifier(ChainVerifier):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): lossless.

    Accept draft x with probability min(1, p(x) / q(x)); on the first reject emit a sample
    from norm(max(0, p - q)); after a fully accepted chain emit a sample from p. With no
    ``draft_dists`` the proposals are taken as deterministic (q one-hot). In greedy mode p is
    one-hot at the argmax, so the rule reduces to ``exact``.
    """

    lossless = True

    def sampled(self, step: VerifyInput, processed: torch.Tensor, top: TopTwo, generator: torch.Generator | None) -> Verdict:
        strict = strict_rejection(probabilities(processed), step.draft_tokens, step.draft_dists, generator)
        return finish(strict.accepted, reasons_from(strict.accepted, Reason.SAMPLED), strict.candidates, top)
