"""Acceptance analytics from the per-position fields of method rows: alpha per draft depth, each
value statistic a verifier declares (``rule_values``) at strict accepts, relaxed accepts and
rejections, acceptance by its bin, and the shadow verifiers' acceptance on the live verifier's own drafts."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mars_bench.bench.stats import percentile_ci
from mars_bench.common.reasons import Reason
from mars_bench.common.settings import parse_label

from .cells import NotEnoughData, method_rows, varying_labels

KEYS = ["model", "drafter", "task", "temperature", "label"]
OUTCOMES = {Reason.EXACT: "strict accept", Reason.SAMPLED: "strict accept", Reason.RELAXED: "relaxed accept",
            Reason.REJECTED: "rejected"}  # fmt: skip
BINS = 10  # acceptance by a statistic's value: at most this many bins, each with about as many positions


def share_of_sums(numerators: np.ndarray, denominators: np.ndarray, axis: int = -1) -> np.ndarray:
    """sum(numerators) / sum(denominators) along ``axis`` (one value per bootstrap resample)."""
    return np.sum(numerators, axis=axis) / np.sum(denominators, axis=axis)


def alpha_per_depth(frame: pd.DataFrame) -> pd.DataFrame:
    """alpha_d = accepted at depth d / drafts that reached depth d (depth 1 = first draft), pooled over a
    setting's rows, with ``reached`` and ``accepted`` (drafts), ``prompts`` (rows with a draft reaching d)
    and the percentile bootstrap 95% CI of alpha_d resampling those rows (a row's drafts kept together:
    positions of one request are not independent)."""
    out = []
    for key, rows in method_rows(frame).groupby(KEYS, sort=True):
        width = max(len(r) for r in rows["reached_per_depth"])
        if not width:
            continue
        accepted, reached = np.zeros((len(rows), width)), np.zeros((len(rows), width))
        for index, (acc, rea) in enumerate(zip(rows["accepted_per_depth"], rows["reached_per_depth"])):
            accepted[index, : len(acc)] = acc
            reached[index, : len(rea)] = rea
        for depth in range(width):
            drafted = reached[:, depth] > 0
            sample = (accepted[drafted, depth], reached[drafted, depth])
            total = reached[:, depth].sum()
            low, high = percentile_ci(sample, share_of_sums, 2000, 0.95, 0) if drafted.any() else (np.nan, np.nan)
            out.append({**dict(zip(KEYS, key)), "depth": depth + 1, "prompts": int(drafted.sum()), "reached": int(total),
                        "accepted": int(accepted[:, depth].sum()),
                        "alpha": accepted[:, depth].sum() / total if total else np.nan,
                        "alpha_ci_low": low, "alpha_ci_high": high})  # fmt: skip
    if not out:
        raise NotEnoughData("no method row has drafts")
    return pd.DataFrame(out)


def value_statistics(frame: pd.DataFrame) -> list[str]:
    """The value statistics the method rows carry (``rule_values``), in the order they first appear."""
    found = [values for values in method_rows(frame)["rule_values"] if isinstance(values, dict)]
    return list(dict.fromkeys(name for values in found for name in values))


def positions(frame: pd.DataFrame, statistic: str) -> pd.DataFrame:
    """One row per verified position of the method rows that carry the value statistic ``statistic``: its
    ``value`` and its outcome, per setting (``KEYS``)."""
    out = []
    for key, rows in method_rows(frame).groupby(KEYS, sort=True):
        found = [values.get(statistic) if isinstance(values, dict) else None for values in rows["rule_values"]]
        # Rows whose values were not recorded for every position (backend=vllm before it traced them) pair with none.
        paired = [(v, r) for v, r in zip(found, rows["reasons"]) if v is not None and len(v) == len(r) and len(r)]
        if paired:
            out.append(pd.DataFrame({**dict(zip(KEYS, key)), "value": [x for v, _ in paired for x in v],
                                     "reason": [x for _, r in paired for x in r]}))  # fmt: skip
    if not out:
        raise NotEnoughData(f"no verified position carries the statistic {statistic}")
    table = pd.concat(out, ignore_index=True)
    table["value"] = pd.to_numeric(table["value"])  # None (not finite) becomes NaN
    table["outcome"] = table["reason"].map(OUTCOMES)
    return table


def value_bins(values: pd.Series, bins: int = BINS) -> np.ndarray:
    """Bin edges for ``values``: their quantiles at 1/bins, 2/bins, ... (3 significant digits, repeats merged),
    between -inf and inf, so that each bin holds about as many positions whatever the statistic's scale."""
    finite = values[np.isfinite(values)]
    inner = np.unique([float(f"{edge:.3g}") for edge in np.quantile(finite, np.arange(1, bins) / bins)]) if len(finite) else []
    return np.array([-np.inf, *inner, np.inf])


def acceptance_by_value(table: pd.DataFrame) -> pd.DataFrame:
    """Acceptance rate of verified positions per bin of a statistic's value (``value_bins``, marked by their edges)."""
    table = table.dropna(subset=["value"]).copy()
    table["bin"] = pd.cut(table["value"], value_bins(table["value"]), right=False)
    table["accepted"] = table["outcome"] != "rejected"
    grouped = table.groupby([*KEYS, "bin"], observed=True)["accepted"]
    out = grouped.agg(positions="size", acceptance_rate="mean").reset_index()
    out["bin_low"] = [interval.left for interval in out["bin"]]
    out["bin_high"] = [interval.right for interval in out["bin"]]
    return out.drop(columns="bin")


def shadow_labels(raw: list[str]) -> dict[str, str]:
    """Recorded shadow names (``name(key=value,...)``, ``common.settings.plugin_label``) -> table labels that
    show the settings which differ between shadows of one verifier (``name (key=0.84)``; one shadow of a
    verifier: its bare name)."""
    parsed = [parse_label(name) for name in raw]
    names = pd.Series([verifier for verifier, _ in parsed], dtype=object)
    return dict(zip(raw, varying_labels(names, [settings for _, settings in parsed])))


def shadow_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting and shadow verifier: the acceptance rate (kept drafts / drafts) of the live
    verifier and what the shadow would have kept of the identical drafts and logits."""
    rows = method_rows(frame)
    if "shadow_accepted" not in rows or not rows["shadow_accepted"].map(lambda s: isinstance(s, dict) and bool(s)).any():
        raise NotEnoughData("no method row carries shadow verifiers (run with shadow=[rejection,mars])")
    labels = shadow_labels(sorted({name for shadows in rows["shadow_accepted"] if isinstance(shadows, dict) for name in shadows}))
    out = []
    for key, group in rows.groupby(KEYS, sort=True):
        drafted = group["drafted"].sum()
        kept: dict[str, int] = {}
        for shadows in group["shadow_accepted"]:
            for name, per_step in (shadows if isinstance(shadows, dict) else {}).items():
                kept[name] = kept.get(name, 0) + sum(per_step)
        live = group["accepted"].sum() / drafted if drafted else np.nan
        for name, count in kept.items():
            shadow = count / drafted if drafted else np.nan
            out.append({**dict(zip(KEYS, key)), "prompts": len(group), "drafted": int(drafted), "live": live,
                        "shadow": labels[name], "shadow_acceptance": shadow,
                        "live_minus_shadow": live - shadow})  # fmt: skip
    return pd.DataFrame(out)
