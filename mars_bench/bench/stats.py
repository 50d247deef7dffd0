"""Speedup statistics over paired per-prompt measurements."""

from __future__ import annotations

import numpy as np


def throughput_ratio(method_tokens, method_seconds, base_tokens, base_seconds) -> float:
    """(sum tokens / sum time) of the method over the same of the baseline."""
    return (np.sum(method_tokens) / np.sum(method_seconds)) / (np.sum(base_tokens) / np.sum(base_seconds))


def bootstrap_ratio_ci(
    method_tokens, method_seconds, base_tokens, base_seconds, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``throughput_ratio``, resampling prompts (pairs kept together)."""
    arrays = [np.asarray(a, dtype=float) for a in (method_tokens, method_seconds, base_tokens, base_seconds)]
    count = len(arrays[0])
    if count < 2:
        return (float("nan"), float("nan"))
    picks = np.random.default_rng(seed).integers(0, count, size=(resamples, count))
    mt, ms, bt, bs = (a[picks].sum(axis=1) for a in arrays)
    ratios = (mt / ms) / (bt / bs)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return float(low), float(high)


def mean_rate_ratio(method_tokens, method_seconds, base_tokens, base_seconds) -> float:
    """The paper convention: mean per-prompt tokens/s of the method over that of the baseline."""
    method_rates = np.asarray(method_tokens, float) / np.asarray(method_seconds, float)
    base_rates = np.asarray(base_tokens, float) / np.asarray(base_seconds, float)
    return float(method_rates.mean() / base_rates.mean())
