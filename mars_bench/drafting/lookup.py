"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of
the context's last n-gram (training-free; Saxena 2023). Proposals are deterministic."""

from __future__ import annotations

import torch

from mars_bench.drafting.base import Draft, Drafter, empty_draft, register_drafter
from mars_bench.verification.sampling import SamplingParams


class LookupDrafter(Drafter):
    """Tries n-gram lengths from ``max_ngram`` down to ``min_ngram``; the longest match wins."""

    name = "lookup"

    def __init__(self, device: torch.device | str = "cpu", max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not isinstance(min_ngram, int) or not isinstance(max_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r} are invalid: allowed are integers 1 <= min_ngram <= max_ngram"
            )
        self.device = torch.device(device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        length = int(context.shape[0])
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = context[: length - 1].unfold(0, n, 1)  # windows that end before the last token
            hits = torch.nonzero((windows == context[length - n :]).all(dim=1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                tokens = context[start : start + max_drafts]
                if tokens.numel():
                    return Draft(tokens.to(self.device), probs=torch.ones(tokens.numel(), device=self.device))
        return empty_draft(self.device)


@register_drafter("lookup")
def lookup_drafter(device: torch.device | str = "cpu", max_ngram: int = 3, min_ngram: int = 1, **_: object) -> LookupDrafter:
    return LookupDrafter(device, max_ngram, min_ngram)
