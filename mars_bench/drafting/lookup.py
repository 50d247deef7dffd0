"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of
the context's last n-gram (training-free; Saxena 2023). Proposals are deterministic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.drafting.base import Draft, DrafterContext, SequenceDrafter, empty_draft, register_drafter
from mars_bench.verification.sampling import SamplingParams


@dataclass(frozen=True)
class LookupSettings:
    """The n-gram lengths tried, from ``max_ngram`` down to ``min_ngram`` (field order is the
    order of the records' ``drafter_setting``)."""

    min_ngram: int = 1
    max_ngram: int = 3

    def __post_init__(self) -> None:
        sizes = (self.min_ngram, self.max_ngram)
        if any(isinstance(n, bool) or not isinstance(n, int) for n in sizes) or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"drafter.min_ngram={self.min_ngram!r}, drafter.max_ngram={self.max_ngram!r} are invalid: "
                "allowed are integers 1 <= min_ngram <= max_ngram"
            )


def lookup_continuation(sequence: torch.Tensor, max_tokens: int, min_ngram: int, max_ngram: int) -> torch.Tensor:
    """The up to ``max_tokens`` tokens that followed the most recent earlier occurrence of the
    last n-gram of ``sequence`` (LongTensor[L]), trying n from ``max_ngram`` down to
    ``min_ngram``: the longest match wins. Empty when nothing matches."""
    length = int(sequence.shape[0])
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sequence[: length - 1].unfold(0, n, 1)  # windows that end before the last token
        hits = torch.nonzero((windows == sequence[length - n :]).all(dim=1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            tokens = sequence[start : start + max_tokens]
            if tokens.numel():
                return tokens
    return sequence[:0]


class LookupDrafter(SequenceDrafter):
    """Tries n-gram lengths from ``max_ngram`` down to ``min_ngram``; the longest match wins.
    Drafts go to ``device``. It keeps no state and costs no forward: a batch's rows are asked one by one."""

    name = "lookup"

    def __init__(self, device: torch.device | str = "cpu", settings: LookupSettings | None = None) -> None:
        self.device = torch.device(device)
        self.settings = settings or LookupSettings()

    def propose_sequence(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        tokens = lookup_continuation(context, max_drafts, self.settings.min_ngram, self.settings.max_ngram)
        if not tokens.numel():
            return empty_draft(self.device)
        return Draft(tokens.to(self.device), probs=torch.ones(tokens.numel(), device=self.device), host_tokens=tokens)


@register_drafter("lookup", settings=LookupSettings)
def lookup_drafter(settings: LookupSettings, context: DrafterContext) -> LookupDrafter:
    return LookupDrafter(context.device if context.device is not None else "cpu", settings)
