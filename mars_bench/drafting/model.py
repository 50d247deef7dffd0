"""A separate small LM drafts a chain of tokens, keeping its own KV cache."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from mars_bench.drafting.base import Draft, Drafter, empty_draft, register_drafter
from mars_bench.kvcache import cached_logits, crop_to
from mars_bench.verification.sampling import SamplingParams, probabilities, process_logits, sample_rows


def check_min_confidence(value: float | None) -> None:
    if value is not None and not 0 < value < 1:
        raise ValueError(f"drafter.min_confidence={value} is invalid: allowed is a number in (0, 1) or null")


class ModelDrafter(Drafter):
    """Drafts autoregressively with ``model`` (any causal LM sharing the target's vocabulary).

    The cache holds the committed context plus the drafter's own unverified drafts; after a
    verdict it is cropped back to the tokens that were kept, so no token is fed twice.
    ``vocab_size``: the target's logits width; drafter distributions are padded or cut to it.
    ``min_confidence``: stop drafting after a token whose draft probability q is below it
    (None: always draft ``max_drafts``). Costs one host sync per drafted token.
    """

    name = "model"

    def __init__(self, model: Any, vocab_size: int | None = None, min_confidence: float | None = None) -> None:
        check_min_confidence(min_confidence)
        self.model = model
        self.vocab_size = vocab_size
        self.min_confidence = min_confidence
        self.cache: DynamicCache | None = None
        self.cached_valid = 0  # leading cache positions that hold committed tokens
        self.cached_total = 0
        self.last_context_len = 0
        self.last_drafted = 0

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached_valid = self.cached_total = 0
        if prompt_ids.numel() > 1:  # the last prompt token is fed with the first draft step
            self._forward(prompt_ids[:-1].to(self.device))
        self.cached_valid = self.cached_total

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = cached_logits(self.model, tokens, self.cache, last_only=True)
        self.cached_total += int(tokens.shape[0])
        return logits[0]

    def _fit_vocab(self, rows: torch.Tensor, fill: float) -> torch.Tensor:
        width = self.vocab_size or rows.shape[-1]
        if rows.shape[-1] == width:
            return rows
        if rows.shape[-1] > width:
            return rows[..., :width]
        return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]), value=fill)

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        if max_drafts <= 0:
            return empty_draft(self.device)
        crop_to(self.cache, self.cached_valid)
        self.cached_total = self.cached_valid
        feed = context[self.cached_valid :].to(self.device)
        tokens, token_probs, dists = [], [], []
        for _ in range(max_drafts):
            logits = self._fit_vocab(self._forward(feed)[None], float("-inf"))
            processed = process_logits(logits, sampling)
            # Greedy drafts still report q under softmax(logits): a confidence for draft-length policies.
            probs = torch.softmax(processed, dim=-1) if sampling.greedy else probabilities(processed, sampling)
            token = torch.argmax(processed, dim=-1) if sampling.greedy else sample_rows(probs, generator)
            tokens.append(token)
            token_probs.append(probs.gather(-1, token[:, None])[:, 0])
            if not sampling.greedy:
                dists.append(probs)
            feed = token
            if self.min_confidence is not None and float(token_probs[-1]) < self.min_confidence:
                break
        self.last_context_len = int(context.shape[0])
        self.last_drafted = len(tokens)
        return Draft(
            tokens=torch.cat(tokens),
            probs=torch.cat(token_probs),
            dists=torch.cat(dists) if dists else None,
        )

    def accept(self, accepted_len: int) -> None:
        # The last drafted token was never fed, so at most drafted - 1 drafts are cached.
        self.cached_valid = self.last_context_len + min(accepted_len, self.last_drafted - 1)


@register_drafter("model")
def model_drafter(
    model: Any = None, vocab_size: int | None = None, min_confidence: float | None = None, **_: object
) -> ModelDrafter:
    if model is None:
        raise ValueError("drafter 'model' needs a separate draft model: allowed drafters without one are layerskip and lookup")
    return ModelDrafter(model, vocab_size, min_confidence)
