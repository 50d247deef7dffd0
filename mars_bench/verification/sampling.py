"""Sampling settings and the one logits processor every verifier and drafter shares.

``process_logits`` applies top-k, then top-p (filtered entries become ``-inf``; ``mars_ref``
alone asks for the official MARS code's order, top-p first) and keeps the logits otherwise
unscaled; ``probabilities`` applies the temperature. Ratios and signs of logits, which is
all a rule comparing logits (``mars``) looks at, do not depend on a positive temperature, and
keeping the scaling inside a max-shifted softmax keeps extreme temperatures (1e-30, 1e30)
finite. At temperature 0 decoding is greedy (argmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

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
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} is invalid: allowed is a finite number >= 0 (0 = greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: allowed is a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: allowed is an integer >= 0 (0 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(logits - rowmax) / temperature: finite wherever the logit is, for any temperature > 0."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted if temperature == 1 else shifted.div_(temperature)


FilterOrder = Literal["top_k_first", "top_p_first"]
FILTER_ORDERS: tuple[FilterOrder, ...] = ("top_k_first", "top_p_first")


def top_k_filter(z: torch.Tensor, top_k: int) -> torch.Tensor:
    """Logits [..., V] with every entry below the k-th largest set to -inf (ties at the k-th kept)."""
    if not 0 < top_k < z.shape[-1]:
        return z
    kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
    return z.masked_fill(z < kth, float("-inf"))


def top_p_filter(z: torch.Tensor, top_p: float, temperature: float) -> torch.Tensor:
    """Logits [..., V] with the entries outside the nucleus of mass ``top_p`` of
    softmax(z / temperature) set to -inf (the top entry is always kept)."""
    if top_p >= 1.0:
        return z
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    sorted_p = torch.softmax(scaled(sorted_z, temperature), dim=-1)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, sampling: SamplingParams, order: FilterOrder = "top_k_first") -> torch.Tensor:
    """Float32 logits [..., V] with top-k and top-p (on the tempered distribution) filtered to -inf.

    order: ``top_k_first`` (transformers' order, used everywhere by default) or
    ``top_p_first`` (the official MARS / EAGLE code's ``prepare_logits_processor``). Top-p
    after top-k measures the nucleus on the renormalised top-k distribution, so it keeps a
    subset of what top-p first keeps; they differ only when both filters are on.
    """
    if order not in FILTER_ORDERS:
        raise ValueError(f"order={order!r} is invalid: allowed are {', '.join(FILTER_ORDERS)}")
    z = logits.float()
    if sampling.greedy:
        return z
    if order == "top_k_first":
        return top_p_filter(top_k_filter(z, sampling.top_k), sampling.top_p, sampling.temperature)
    return top_k_filter(top_p_filter(z, sampling.top_p, sampling.temperature), sampling.top_k)


def probabilities(processed: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """softmax(processed / temperature), float32 [..., V] (one-hot at the argmax when greedy)."""
    if sampling.greedy:
        return torch.zeros_like(processed).scatter_(-1, processed.argmax(dim=-1, keepdim=True), 1.0)
    # scaled() puts each row's maximum at 0, so exp cannot overflow and the sum is >= 1.
    weights = scaled(processed, sampling.temperature).exp_()
    return weights.div_(weights.sum(dim=-1, keepdim=True))


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row of ``probs`` ([R, V], unnormalised is fine) -> LongTensor[R], no host sync.

    Inverse-CDF sampling: one uniform per row against the row's cumulative sum. The sum is
    taken in float64: in float32 each partial sum near 1 is rounded by up to 6e-8, more than
    most tokens' probability in a 150k vocabulary, so rounding would move their mass. One
    uniform per row instead of one exponential per entry (the race vLLM uses on GPUs): on 2
    CPU cores a draw from 6 rows of 152k takes 0.7 ms this way and 18 ms as a race, which was
    more than the rest of a rejection-sampling step together.

    uniform: FloatTensor[R, 1] of float64 uniforms to use (``RandomStreams.sample``), or None to
    draw them from ``generator``.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[..., -1:]
    if uniform is None:
        uniform = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    # u < total strictly, so some entry of the cdf exceeds it; a zero-probability token
    # repeats its predecessor's cdf value and can never be the first to exceed u.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


Generators = torch.Generator | Sequence[torch.Generator | None] | None


@dataclass(frozen=True)
class RandomStreams:
    """Where one verification step's random numbers come from.

    generators: one generator (or None: torch's default) that the whole step draws from in
    order, or one per request of a batched step, so that a request's draws, and hence its
    verdict, do not depend on which other requests share its batch. A request draws from its
    stream exactly what it draws when judged alone: its nodes' uniforms, then its samples.
    drafts_per_row: N_b per request.
    """

    generators: tuple[torch.Generator | None, ...]
    drafts_per_row: tuple[int, ...]

    @staticmethod
    def of(generator: Generators, drafts_per_row: tuple[int, ...]) -> RandomStreams:
        """Streams from ``generator``: one generator for the step, or a sequence of one per request."""
        if generator is None or isinstance(generator, torch.Generator):
            return RandomStreams((generator,), drafts_per_row)
        generators = tuple(generator)
        if len(generators) != len(drafts_per_row):
            raise ValueError(
                f"generator: got {len(generators)} generators for a batch of {len(drafts_per_row)} requests: "
                "allowed is one generator for the step, or one per request"
            )
        return RandomStreams(generators, drafts_per_row)

    def uniforms(
        self, per_request: Sequence[int], device: torch.device, dtype: torch.dtype, width: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Uniforms in [0, 1): ``per_request[b]`` of them (each of shape ``width``) from request b's stream,
        concatenated ([sum, *width]); one draw for all when the step has one stream."""
        if len(self.generators) == 1:
            return torch.rand((sum(per_request), *width), generator=self.generators[0], dtype=dtype, device=device)
        draws = zip(per_request, self.generators)
        return torch.cat([torch.rand((count, *width), generator=stream, dtype=dtype, device=device) for count, stream in draws])

    def node_uniforms(self, device: torch.device) -> torch.Tensor:
        """FloatTensor[N]: one float32 uniform per drafted node."""
        return self.uniforms(self.drafts_per_row, device, torch.float32)

    def sample(self, weights: torch.Tensor, per_request: Sequence[int]) -> torch.Tensor:
        """LongTensor[R]: one token per row of ``weights`` ([R, V]), request b's ``per_request[b]``
        rows with uniforms from its own stream (``sample_rows``)."""
        uniform = self.uniforms(per_request, weights.device, torch.float64, (1,))
        return sample_rows(weights, None, uniform=uniform)


def choose_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of raw ``logits`` [R, V]: argmax when greedy, else a sample."""
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    return sample_rows(probabilities(process_logits(logits, sampling), sampling), generator)
