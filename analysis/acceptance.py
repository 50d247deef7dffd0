"""Acceptance analytics from the per-position fields of method rows: alpha per draft depth,
the margin statistic (z2 / z1) at strict accepts, relaxed accepts and rejections, acceptance
by margin bin, and the shadow verifiers' acceptance on the live verifier's own drafts."""

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
MARGIN_BINS = np.array([-np.inf, 0.5, 0.6, 0.7, 0.75, 0.8, 0.84, 0.88, 0.9, 0.92, 0.94, 0.96, 0.98, 1.0, np.inf])


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


def positions(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per verified position: its margin z2 / z1 and its outcome, per setting (``KEYS``)."""
    out = []
    for key, rows in method_rows(frame).groupby(KEYS, sort=True):
        # Rows whose margins were not recorded (backend=vllm before it traced them) have none to pair with.
        paired = rows[[len(m) == len(r) for m, r in zip(rows["margins"], rows["reasons"])]]
        margins = [m for row in paired["margins"] for m in row]
        reasons = [r for row in paired["reasons"] for r in row]
        out.append(pd.DataFrame({**dict(zip(KEYS, key)), "margin": margins, "reason": reasons}))
    table = pd.concat(out, ignore_index=True) if out else pd.DataFrame()
    if table.empty:
        raise NotEnoughData("no verified positions in the method rows")
    table["margin"] = pd.to_numeric(table["margin"])  # None (z1 not finite) becomes NaN
    table["outcome"] = table["reason"].map(OUTCOMES)
    return table


def acceptance_by_margin(table: pd.DataFrame) -> pd.DataFrame:
    """Acceptance rate of verified positions per margin bin (bins marked by their edges)."""
    table = table.dropna(subset=["margin"]).copy()
    table["bin"] = pd.cut(table["margin"], MARGIN_BINS, right=False)
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
