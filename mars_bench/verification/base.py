"""The verifier contract: inputs, verdicts, reason codes and the registry.

A verifier is a pure tensor function: it sees the drafted nodes, the drafter's
probabilities and the target's raw logits, and decides which drafts to keep and which
token to emit after them. It never calls a model and never does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch

from mars_bench.verification.sampling import SamplingParams


class Reason(IntEnum):
    """Why a drafted node was accepted or rejected at a visited depth."""

    EXACT = 0  # the target's own choice (argmax in greedy, the strict rule otherwise)
    RELAXED = 1  # accepted only because of a lossy rule (margin, typical)
    SAMPLED = 2  # accepted by a random acceptance test (min(1, p/q))
    REJECTED = 3


@dataclass(frozen=True)
class VerifyInput:
    """One verification step. N drafted nodes; V vocabulary entries.

    draft_tokens: LongTensor[N], the drafted token ids.
    parents: LongTensor[N] on the CPU, parent node index, -1 for the root (the last
        committed token). A chain has parents [-1, 0, 1, ...].
    draft_probs: FloatTensor[N] or None, q(token) under the drafter's processed distribution.
    draft_dists: FloatTensor[N, V] or None, the drafter's full processed distributions. None
        means the drafts were chosen deterministically (q is one-hot at the draft).
    target_logits: FloatTensor[N + 1, V], raw target logits at the root and after every node.
    sampling: the processing (temperature, top_p, top_k) every verifier applies.
    """

    draft_tokens: torch.Tensor
    parents: torch.Tensor
    target_logits: torch.Tensor
    sampling: SamplingParams = SamplingParams()
    draft_probs: torch.Tensor | None = None
    draft_dists: torch.Tensor | None = None

    @property
    def num_drafts(self) -> int:
        return int(self.draft_tokens.shape[0])

    def check(self) -> None:
        """Raise ValueError on inconsistent shapes (cheap: no host-device sync)."""
        n = self.num_drafts
        if self.draft_tokens.dim() != 1:
            raise ValueError(f"draft_tokens must be 1-D, got shape {tuple(self.draft_tokens.shape)}")
        if self.target_logits.dim() != 2 or self.target_logits.shape[0] != n + 1:
            raise ValueError(f"target_logits must have shape [N+1, V] = [{n + 1}, V], got {tuple(self.target_logits.shape)}")
        if self.target_logits.shape[1] < 1:
            raise ValueError("target_logits has an empty vocabulary axis")
        if tuple(self.parents.shape) != (n,):
            raise ValueError(f"parents must have shape [{n}], got {tuple(self.parents.shape)}")
        if self.draft_probs is not None and tuple(self.draft_probs.shape) != (n,):
            raise ValueError(f"draft_probs must have shape [{n}], got {tuple(self.draft_probs.shape)}")
        if self.draft_dists is not None and tuple(self.draft_dists.shape) != (n, self.target_logits.shape[1]):
            raise ValueError(
                f"draft_dists must have shape [{n}, {self.target_logits.shape[1]}], got {tuple(self.draft_dists.shape)}"
            )


@dataclass(frozen=True)
class Decisions:
    """Per visited depth (D = number of drafted positions judged), on the CPU.

    reasons: LongTensor[D] of Reason codes.
    top1_logit, top2_logit: FloatTensor[D], the two largest processed target logits.
    margin: FloatTensor[D], the MARS statistic z2 / z1 (inf or nan where z1 == 0).
    """

    reasons: torch.Tensor
    top1_logit: torch.Tensor
    top2_logit: torch.Tensor
    margin: torch.Tensor

    @property
    def relaxed_count(self) -> int:
        return int((self.reasons == Reason.RELAXED).sum())


@dataclass(frozen=True)
class Verdict:
    """The outcome of one step.

    accepted: LongTensor[A], node indices of the accepted path, root to leaf.
    next_token: the bonus / correction token emitted after the path.
    decisions: what happened at every visited depth.
    """

    accepted: torch.Tensor
    next_token: int
    decisions: Decisions

    @property
    def accepted_len(self) -> int:
        return int(self.accepted.shape[0])


class Verifier:
    """Base class: subclasses set ``name`` and ``lossless`` and implement ``verify``."""

    name: ClassVar[str]
    lossless: ClassVar[bool]

    def verify(self, step: VerifyInput, *, generator: torch.Generator | None = None) -> Verdict:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        """The verifier's settings, for records and manifests."""
        return {"name": self.name}


_REGISTRY: dict[str, Callable[..., Verifier]] = {}


def register_verifier(name: str) -> Callable[[type[Verifier]], type[Verifier]]:
    """Class decorator: make a verifier available to ``get_verifier(name)``."""

    def wrap(cls: type[Verifier]) -> type[Verifier]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_verifiers() -> list[str]:
    return sorted(_REGISTRY)


def get_verifier(name: str, **params: object) -> Verifier:
    """Build the verifier registered as ``name`` with its settings."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown verifier {name!r}: allowed are {', '.join(available_verifiers())}")
    return _REGISTRY[name](**params)
