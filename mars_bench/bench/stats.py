"""Statistics over paired per-prompt measurements: speedups, bootstrap intervals, a paired test.

The intervals are ``scipy.stats.bootstrap``'s percentile intervals, resampling prompts (a prompt's
numbers kept together) with a seeded generator, so that a table comes out the same on every run.
The paired sign-flip test is our own: it gives ``scipy.stats.permutation_test``'s p-values where
both enumerate every sign pattern (tests/test_analysis.py checks it) at a fraction of the cost, and
the quality table runs one per method.
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def throughput_ratio(method_tokens, method_seconds, base_tokens, base_seconds, axis=None) -> float:
    """(sum tokens / sum time) of the method over the same of the baseline (along ``axis``: one per resample)."""
    method = np.sum(method_tokens, axis=axis) / np.sum(method_seconds, axis=axis)
    return method / (np.sum(base_tokens, axis=axis) / np.sum(base_seconds, axis=axis))


def percentile_ci(data: tuple[np.ndarray, ...], statistic, resamples: int, level: float, seed: int) -> tuple[float, float]:
    """The percentile bootstrap CI of ``statistic`` over the prompts of ``data`` (arrays of one value per
    prompt, resampled together); NaN for fewer than two prompts."""
    if len(data[0]) < 2:
        return (float("nan"), float("nan"))
    result = stats.bootstrap(data, statistic, n_resamples=resamples, confidence_level=level, method="percentile",
                             paired=True, vectorized=True, rng=np.random.default_rng(seed))  # fmt: skip
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def bootstrap_ratio_ci(
    method_tokens, method_seconds, base_tokens, base_seconds, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of ``throughput_ratio``, resampling prompts (pairs kept together)."""
    arrays = tuple(np.asarray(a, dtype=float) for a in (method_tokens, method_seconds, base_tokens, base_seconds))
    return percentile_ci(arrays, throughput_ratio, resamples, level, seed)


def mean_rate_ratio(method_tokens, method_seconds, base_tokens, base_seconds) -> float:
    """The paper convention: mean per-prompt tokens/s of the method over that of the baseline."""
    method_rates = np.asarray(method_tokens, float) / np.asarray(method_seconds, float)
    base_rates = np.asarray(base_tokens, float) / np.asarray(base_seconds, float)
    return float(method_rates.mean() / base_rates.mean())


def bootstrap_mean_ci(values, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (for paired data: pass the per-prompt differences)."""
    return percentile_ci((np.asarray(values, dtype=float),), np.mean, resamples, level, seed)


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


def wilson_interval(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``successes`` / ``trials`` (NaN for no trials)."""
    if trials == 0:
        return (float("nan"), float("nan"))
    interval = stats.binomtest(successes, trials).proportion_ci(confidence_level=level, method="wilson")
    return float(interval.low), float(interval.high)


def wilson_share(hits: int, total: int) -> dict[str, object]:
    """A share as the measurement scripts report it: ``hits`` of ``total``, the share and its Wilson 95% interval
    (each rounded to 4 places; the share None for no trials)."""
    low, high = wilson_interval(hits, total)
    share = round(hits / total, 4) if total else None
    return {"hits": hits, "of": total, "share": share, "wilson95": [round(low, 4), round(high, 4)]}
