"""Sampling settings and the one logits processor every verifier and drafter shares.

The processor turns raw logits into *processed* logits: divided by the temperature, then
top-k and top-p filtered (filtered entries become ``-inf``). At temperature 0 decoding is
greedy and the raw logits are returned unchanged (argmax is all that is used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits.

    temperature: 0 means greedy; > 0 samples from softmax(logits / temperature).
    top_p: nucleus mass kept, in (0, 1]; 1 keeps everything.
    top_k: number of most likely tokens kept; 0 keeps everything.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: allowed is a number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: allowed is a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: allowed is an integer >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Processed float32 logits, same shape as ``logits`` ([..., V]).

    Temperature scaling, then top-k, then top-p; filtered entries are ``-inf``.
    Greedy settings return the raw logits as float32.
    """
    z = logits.float()
    if sampling.greedy:
        return z
    if sampling.temperature != 1.0:
        z = z / sampling.temperature
    vocab = z.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= sampling.top_p  # always keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z


def probabilities(processed_logits: torch.Tensor) -> torch.Tensor:
    """softmax of processed logits, float32, [..., V]."""
    return torch.softmax(processed_logits, dim=-1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` ([R, V] -> LongTensor[R]), no host sync.

    Uses the exponential-race form (argmax of p / E, E ~ Exp(1)), which draws from p exactly
    and batches over rows the way vLLM's sampler does.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    # An exact 0 draw would make 0/0 = NaN win the argmax for an impossible token.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return torch.argmax(probs / noise, dim=-1)


def choose_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of raw ``logits`` [R, V]: argmax when greedy, else a sample."""
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    return sample_rows(probabilities(process_logits(logits, sampling)), generator)
