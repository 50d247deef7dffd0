"""The drafter interface: propose a chain of tokens with their draft probabilities."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.models import input_device
from mars_bench.verification.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """N proposed tokens: a chain, or a tree when ``parents`` is given.

    tokens: LongTensor[N] on the target's device.
    parents: LongTensor[N] on the CPU or None (a chain): each node's parent node, -1 for a
        child of the root, parents before children (see ``drafting/tree.py``).
    probs: FloatTensor[N] or None, q(token) under the drafter's processed distribution.
    dists: FloatTensor[N, V] or None, the full processed distributions (only when the
        drafter sampled; None means the tokens were chosen deterministically).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    dists: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter:
    """Proposes tokens after the committed context.

    Lifecycle per prompt: ``begin(prompt_ids)`` once (may prefill a cache), then per step
    ``propose(context, max_drafts, ...)`` and ``accept(path)``. ``context`` holds every
    committed token (prompt and generated) as a CPU LongTensor[T]. ``max_drafts`` (>= 1: the
    engine asks for no drafts by not calling ``propose``) bounds the number of drafted tokens
    on any path: a chain's length, a tree's depth.

    A drafter that reads the target's hidden states (EAGLE) names the entries of the
    target's ``output_hidden_states`` it needs in ``hidden_layers``; the engine then hands it
    ``features``, those entries concatenated along the hidden axis ([rows, len * hidden]),
    for every committed token but the newest, computed by the target forwards the engine
    runs anyway: the prompt's rows in ``begin``, the root's and the accepted nodes' rows in
    ``accept``.
    """

    name: str = "base"
    hidden_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Start a new sequence (prompt_ids: CPU LongTensor[L]; features: [L, F] or None)."""

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        raise NotImplementedError

    def accept(self, path: list[int], features: torch.Tensor | None = None) -> None:
        """The verifier kept the drafted nodes ``path`` (node indices, root to leaf) of the last
        proposal; for a chain that is ``range(accepted_len)``. features: [len(path) + 1, F]
        (the root's row, then the path's) or None."""

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
    the target, the separate ``draft_model`` and ``options`` (layers, max_ngram, min_ngram,
    top_k, tree_tokens, head, ...) and ignores the rest."""
    device = input_device(target)
    return build_drafter(name, target=target, model=draft_model, vocab_size=target.config.vocab_size, device=device, **options)


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device))
