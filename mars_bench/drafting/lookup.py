"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of
the context's last n-gram (training-free; Saxena 2023). Proposals are deterministic."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mars_bench.drafting.base import Draft, Drafter, DrafterContext, empty_draft, register_drafter
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


class LookupDrafter(Drafter):
    """Tries n-gram lengths from ``max_ngram`` down to ``min_ngram``; the longest match wins.
    Drafts go to ``device``."""

    name = "lookup"

    def __init__(self, device: torch.device | str = "cpu", settings: LookupSettings | None = None) -> None:
        self.device = torch.device(device)
        self.settings = settings or LookupSettings()

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        length = int(context.shape[0])
        for n in range(min(self.settings.max_ngram, length - 1), self.settings.min_ngram - 1, -1):
            windows = context[: length - 1].unfold(0, n, 1)  # windows that end before the last token
            hits = torch.nonzero((windows == context[length - n :]).all(dim=1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                tokens = context[start : start + max_drafts]
                if tokens.numel():
                    return Draft(tokens.to(self.device), probs=torch.ones(tokens.numel(), device=self.device), host_tokens=tokens)
        return empty_draft(self.device)


@register_drafter("lookup", settings=LookupSettings)
def lookup_drafter(settings: LookupSettings, context: DrafterContext) -> LookupDrafter:
    return LookupDrafter(context.device if context.device is not None else "cpu", settings)
