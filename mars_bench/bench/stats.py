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


def bootstrap_mean_ci(values, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (for paired data: pass the per-prompt differences)."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        return (float("nan"), float("nan"))
    means = data[np.random.default_rng(seed).integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def paired_permutation_p(differences, *, rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided sign-flip permutation test of "mean paired difference = 0".

    Exact (all 2^n sign patterns) for up to 16 non-zero differences, Monte Carlo otherwise.
    Valid for binary scores (pass/fail) and continuous ones alike; zeros carry no information.
    """
    data = np.asarray(differences, dtype=float)
    data = data[data != 0]
    if data.size == 0:
        return 1.0
    observed = abs(data.sum())
    if data.size <= 16:
        signs = 1 - 2 * ((np.arange(2**data.size)[:, None] >> np.arange(data.size)) & 1)
    else:
        signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=(rounds, data.size))
    totals = np.abs(signs @ data)
    return float(np.mean(totals >= observed - 1e-12))
