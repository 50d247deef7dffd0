"""The drafter interface: propose a chain of tokens with their draft probabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.verification.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """N proposed tokens (a chain).

    tokens: LongTensor[N] on the target's device.
    probs: FloatTensor[N] or None, q(token) under the drafter's processed distribution.
    dists: FloatTensor[N, V] or None, the full processed distributions (only when the
        drafter sampled; None means the tokens were chosen deterministically).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    dists: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter:
    """Proposes tokens after the committed context.

    Lifecycle per prompt: ``begin(prompt_ids)`` once (may prefill a cache), then per step
    ``propose(context, max_drafts, ...)`` and ``accept(accepted_len)``. ``context`` holds
    every committed token (prompt and generated) as a CPU LongTensor[T].
    """

    name: str = "base"

    def begin(self, prompt_ids: torch.Tensor) -> None:
        """Start a new sequence (prompt_ids: CPU LongTensor[L])."""

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        raise NotImplementedError

    def accept(self, accepted_len: int) -> None:
        """The verifier kept the first ``accepted_len`` drafts of the last proposal."""

    def describe(self) -> dict[str, object]:
        return {"name": self.name}


DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register_drafter(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_drafters() -> list[str]:
    return sorted([*_REGISTRY, "none"])


def check_drafter_name(name: str) -> str:
    if name != "none" and name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}: allowed are {', '.join(available_drafters())}")
    return name


def build_drafter(name: str, **params: object) -> Drafter | None:
    """The drafter registered as ``name`` (``none`` gives None: plain autoregressive decoding)."""
    check_drafter_name(name)
    return None if name == "none" else _REGISTRY[name](**params)


def drafter_for(name: str, target: Any, draft_model: Any = None, **options: object) -> Drafter | None:
    """The drafter ``name`` for ``target`` (a causal LM): every factory takes what it needs from
    the target, the separate ``draft_model`` and ``options`` (layers, max_ngram, min_ngram)."""
    device = target.get_input_embeddings().weight.device
    return build_drafter(name, target=target, model=draft_model, vocab_size=target.config.vocab_size, device=device, **options)


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device))
