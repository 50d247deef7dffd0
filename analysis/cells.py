"""Per-setting numbers that every table and figure shares.

A setting is (model, drafter, draft length, task, temperature, verifier, theta). Its method rows are
paired with the baseline row of the same run folder and prompt; several runs of one setting
(resumed sweeps, other machines) pool their prompts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.gather import finished
from mars_bench.bench.stats import bootstrap_mean_ci, bootstrap_ratio_ci, throughput_ratio

BASELINE = "baseline"
SETTING = ["model", "drafter", "draft_length", "task", "temperature", "verifier", "theta"]
PROMPT = ["question_id", "turn"]


class NotEnoughData(ValueError):
    """A table or figure cannot be made from these records; the message says what is missing."""


def method_label(verifier: str, theta: float | None, draft_length: str = "fixed") -> str:
    has_theta = verifier in ("mars", "mars_ref") and theta is not None and not pd.isna(theta)
    label = f"{verifier} (theta {theta:g})" if has_theta else verifier
    return label if draft_length == "fixed" else f"{label}, {draft_length} length"


def method_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished rows of the verifiers (not the baselines), one per setting and prompt, labelled."""
    ok = finished(frame)
    rows = ok[ok["method"] != BASELINE].copy()
    if rows.empty:
        raise NotEnoughData("no finished method rows (only baselines or failures)")
    rows["label"] = [method_label(v, t, n) for v, t, n in zip(rows["verifier"], rows["theta"], rows["draft_length"])]
    return rows


def baseline_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished baseline rows, one per (model, task, temperature, prompt): cells of a sweep share them."""
    ok = finished(frame)
    base = ok[ok["method"] == BASELINE]
    return base.drop_duplicates(["model", "task", "temperature", *PROMPT])


def paired(frame: pd.DataFrame) -> pd.DataFrame:
    """Method rows with the baseline of their own run folder and prompt (columns ``*_base``)."""
    ok = finished(frame)
    base = ok[ok["method"] == BASELINE][["run_dir", *PROMPT, "new_tokens", "seconds"]]
    pairs = method_rows(frame).merge(base, on=["run_dir", *PROMPT], suffixes=("", "_base"))
    if pairs.empty:
        raise NotEnoughData("no run folder has both baseline and method rows for the same prompt")
    return pairs


def summarise_setting(rows: pd.DataFrame) -> dict[str, float]:
    """Speed, acceptance and quality of one setting's paired rows."""
    speed = (rows["new_tokens"], rows["seconds"], rows["new_tokens_base"], rows["seconds_base"])
    low, high = bootstrap_ratio_ci(*speed)
    scores = rows["score"].dropna()
    score_low, score_high = bootstrap_mean_ci(scores)
    steps, drafted, verified = rows["steps"].sum(), rows["drafted"].sum(), rows["verified_positions"].sum()
    return {
        "prompts": len(rows),
        "speedup": throughput_ratio(*speed),
        "speedup_ci_low": low,
        "speedup_ci_high": high,
        "tau": rows["emitted"].sum() / steps if steps else np.nan,
        "acceptance_rate": rows["accepted"].sum() / drafted if drafted else np.nan,
        "relaxed_share": rows["relaxed"].sum() / rows["accepted"].sum() if rows["accepted"].sum() else np.nan,
        "trigger_rate": rows["trigger_count"].sum() / verified if verified else np.nan,
        "score": scores.mean() if len(scores) else np.nan,
        "score_ci_low": score_low,
        "score_ci_high": score_high,
    }


def method_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per setting: prompts, speedup [CI], tau, acceptance, trigger rate, score [CI]."""
    pairs = paired(frame)
    out = []
    for key, rows in pairs.groupby(SETTING, dropna=False, sort=True):
        rows = rows.drop_duplicates(["run_dir", *PROMPT])
        out.append({**dict(zip(SETTING, key)), "label": rows["label"].iloc[0], **summarise_setting(rows)})
    return pd.DataFrame(out)
