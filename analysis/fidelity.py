"""Fidelity to the target, from the ``fidelity`` field of method rows (records schema 5): per
verifier judged on a run's drafts (the live one first, then each shadow), per-record sums of the
exact acceptance probability alpha_V, KL(P_V || p) and TV(P_V, p) of the emitted token's
distribution P_V against the target's p, and TV(q, p) of the drafter's proposal.

``fidelity_table`` sets every rule's expected acceptance against what it costs in KL and TV, with
its gain over the strict rule on the very same drafts and its distance to the bound
alpha_V <= 1 - TV(q, p) + TV(P_V, p); ``decomposition_table`` gives, per cell of a sweep, speed
next to the live verifier's sequence-level KL per generated token and its deviation rate.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from mars_bench.bench.records import BASELINE
from mars_bench.bench.stats import bootstrap_mean_ci
from mars_bench.bench.summary import PROMPT, finished, pair_with_baseline, summarise_paired
from mars_bench.common.strict_rule import strict_verifier

from .acceptance import shadow_labels
from .cells import BASELINE_IDENTITY, SETTING, NotEnoughData, method_rows

NO_FIDELITY = "no method row carries fidelity (run with fidelity=true)"
KL_ZERO = 1e-8  # nats per position: a lossless rule's KL comes out at float32 rounding level (~3e-10), not 0
ALL_TASKS = "all"


def has_fidelity(value: object) -> bool:
    return isinstance(value, dict) and bool(value)


def fidelity_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished method rows (labelled as in cells.method_rows) whose ``fidelity`` is a non-empty mapping."""
    rows = method_rows(frame)
    if "fidelity" not in rows:
        raise NotEnoughData(NO_FIDELITY)
    rows = rows[rows["fidelity"].map(has_fidelity)]
    if rows.empty:
        raise NotEnoughData(NO_FIDELITY)
    return rows


def pooled(entries: list[dict], field: str) -> float:
    """The sum of ``field`` over per-record entries; NaN where any record lacks a finite value
    (greedy KL, infinite KL, trees' draft TV): a partial sum would understate it."""
    total = 0.0
    for entry in entries:
        value = entry.get(field)
        if value is None or not math.isfinite(value):
            return np.nan
        total += value
    return total


def per(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else np.nan


def live_rule(fidelity: dict) -> str:
    """The live verifier's entry: the first one recorded."""
    return next(iter(fidelity))


def score_columns(scores: pd.Series) -> dict[str, float]:
    """Mean score (per record) with its bootstrap 95% CI; NaN where no record has a score."""
    scores = pd.to_numeric(scores, errors="coerce").dropna()
    low, high = bootstrap_mean_ci(scores)
    return {"score": scores.mean() if len(scores) else np.nan, "score_ci_low": low, "score_ci_high": high}


def fidelity_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (setting of cells.SETTING, rule judged on its drafts), pooled over its records.

    Columns: the setting, ``live`` (its label), ``rule`` (the recorded name), ``role`` (live or
    shadow), ``family`` (the verifier name) and ``parameters`` (the settings that vary between
    rules of one family), ``prompts`` (records), ``positions`` (drafted positions judged),
    ``acceptance`` (mean alpha_V per position), ``strict`` and ``strict_acceptance`` (rejection when
    sampling, exact when greedy, on the same records), ``gain`` (acceptance - strict_acceptance),
    ``kl_per_position`` (nats; NaN in greedy mode or where infinite), ``tv_per_position`` (greedy:
    the share of positions whose emitted token is not the target's argmax), ``draft_tv_per_position``
    (TV(q, p); NaN for trees), ``bound`` (1 - draft TV + TV, the most acceptance any rule can have
    at that TV) and ``bound_gap`` (bound - acceptance, >= 0), ``gain_per_kl`` (gain / KL per
    position; NaN where the KL is below KL_ZERO or missing), ``steps`` and ``expected_tau``
    (1 + expected kept drafts per step; NaN for trees), and ``score`` [CI] on the live row only
    (a shadow emits no text of its own).
    """
    rows = fidelity_rows(frame)
    labels = shadow_labels(sorted({rule for fidelity in rows["fidelity"] for rule in fidelity}))
    out = []
    for key, group in rows.groupby(SETTING, dropna=False, sort=True):
        setting = dict(zip(SETTING, key))
        records = list(group["fidelity"])
        rules = list(dict.fromkeys(rule for fidelity in records for rule in fidelity))  # as recorded
        live = {live_rule(fidelity) for fidelity in records}
        strict = strict_verifier(setting["temperature"])
        scores = score_columns(group["score"] if "score" in group else pd.Series(dtype=float))
        for rule in sorted(rules, key=lambda rule: rule not in live):  # the live rule first
            mine = [fidelity[rule] for fidelity in records if rule in fidelity]
            reference = [fidelity[strict] for fidelity in records if rule in fidelity and strict in fidelity]
            strict_acceptance = (per(pooled(reference, "accept"), pooled(reference, "positions"))
                                 if len(reference) == len(mine) else np.nan)  # on the very same records, or none  # fmt: skip
            positions = pooled(mine, "positions")
            acceptance = per(pooled(mine, "accept"), positions)
            kl = per(pooled(mine, "kl"), positions)
            tv = per(pooled(mine, "tv"), positions)
            draft_tv = per(pooled(mine, "draft_tv"), positions)
            gain = acceptance - strict_acceptance
            steps = pooled(mine, "steps")
            family, _, parameters = labels[rule].partition(" (")
            role = "live" if rule in live else "shadow"
            out.append({**setting, "live": group["label"].iloc[0], "rule": rule, "role": role,
                        "family": family, "parameters": parameters.rstrip(")"), "prompts": len(mine),
                        "positions": int(positions) if pd.notna(positions) else positions, "acceptance": acceptance,
                        "strict": strict, "strict_acceptance": strict_acceptance, "gain": gain,
                        "kl_per_position": kl, "tv_per_position": tv, "draft_tv_per_position": draft_tv,
                        "bound": 1.0 - draft_tv + tv, "bound_gap": 1.0 - draft_tv + tv - acceptance,
                        "gain_per_kl": gain / kl if kl > KL_ZERO else np.nan,
                        "steps": int(steps) if pd.notna(steps) else steps,
                        "expected_tau": 1.0 + per(pooled(mine, "expected_accepted"), steps),
                        **(scores if role == "live" else dict.fromkeys(scores, np.nan))})  # fmt: skip
    return pd.DataFrame(out)


def natural_key(text: str) -> list:
    """``SWEEP/2_gsm8k`` before ``SWEEP/10_humaneval``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def cell_order(rows: pd.DataFrame) -> pd.Series:
    """Each row's place in the sweep: its ``cell`` as an integer where every cell is one, else the
    order in which cells first appear, run folders taken in natural order (hydra numbers a sweep's
    folders ``0_...``, ``1_...``, ..., ``10_...``; a plain sort would put 10 before 2)."""
    cells = rows["cell"].astype(str)
    if cells.str.fullmatch(r"\d+").all():
        return cells.astype(int)
    folders = rows["run_dir"].astype(str) if "run_dir" in rows else pd.Series("", index=rows.index)
    ordered = sorted(range(len(rows)), key=lambda i: natural_key(folders.iloc[i]))  # stable: ties keep row order
    first: dict[str, int] = {}
    for i in ordered:
        first.setdefault(cells.iloc[i], len(first))
    return cells.map(first)


def live_sums(group: pd.DataFrame) -> dict[str, float]:
    """The live verifier's sums over the records: judged KL and TV (its own walk), accept and
    positions, expected kept drafts and steps; NaN where some record lacks a finite value."""
    entries = [fidelity[live_rule(fidelity)] if has_fidelity(fidelity) else {} for fidelity in group["fidelity"]]
    return {field: pooled(entries, field) for field in ("judged_kl", "judged_tv", "accept", "positions",
                                                        "expected_accepted", "steps")}  # fmt: skip


def cost_per_token(group: pd.DataFrame) -> dict[str, float]:
    """The live verifier's cost per generated token over ``group``'s records: ``kl_per_token`` (sum of judged KL /
    sum of new tokens, nats: an unbiased estimate of the sequence-level KL(verifier's output || target's) per token)
    and ``deviation_rate`` (judged TV / new tokens); NaN where some record carries no fidelity."""
    if "fidelity" not in group:
        return {"kl_per_token": np.nan, "deviation_rate": np.nan}
    live = live_sums(group)
    tokens = group["new_tokens"].sum()
    return {"kl_per_token": per(live["judged_kl"], tokens), "deviation_rate": per(live["judged_tv"], tokens)}


def decomposition_row(group: pd.DataFrame, include_disturbed: bool = False) -> dict:
    """Speed, tau and score (bench.summary's numbers) with the live verifier's cost per generated
    token (``cost_per_token``)."""
    summary = summarise_paired(group, include_disturbed)
    live = live_sums(group)
    return {"prompts": summary["prompts"], "tokens": summary["tokens"], "tau": summary["tau"],
            "tau_request_mean": summary["tau_request_mean"],
            "expected_tau": 1.0 + per(live["expected_accepted"], live["steps"]),
            "acceptance_rate": summary["acceptance_rate"], "expected_acceptance": per(live["accept"], live["positions"]),
            "speedup": summary["speedup"], "speedup_ci_low": summary["speedup_ci_low"],
            "speedup_ci_high": summary["speedup_ci_high"], **cost_per_token(group), "score": summary["score"],
            "score_ci_low": summary["score_ci_low"], "score_ci_high": summary["score_ci_high"]}  # fmt: skip


def decomposition_table(frame: pd.DataFrame, include_disturbed: bool = False) -> pd.DataFrame:
    """One row per cell (live verifier and setting, per task), in the sweep's cell order, then one
    pooled ``task = all`` row per setting where the sweep has several tasks (in the order of each
    setting's first cell). Each method row is paired with the baseline row of its own run folder,
    baseline identity (cells.BASELINE_IDENTITY) and prompt; speedups use the rows that have one (NaN
    where none has), less the disturbed ones unless ``include_disturbed``, everything else every row.
    A setting run without fidelity keeps its speed and score, its KL and deviation rate NaN.

    Columns: ``cell`` (its name; empty on pooled rows), the setting, ``live`` (its label), then
    prompts, tokens, tau (pooled), tau_request_mean (bench.summary.tau_request_mean), expected_tau,
    acceptance_rate, expected_acceptance, speedup [CI], kl_per_token (nats), deviation_rate, score [CI].
    """
    methods = method_rows(frame)
    if "fidelity" not in methods or not methods["fidelity"].map(has_fidelity).any():
        raise NotEnoughData(NO_FIDELITY)
    ok = finished(frame)
    on = ["run_dir", *BASELINE_IDENTITY, *PROMPT]
    baselines = ok[ok["method"] == BASELINE].drop_duplicates(on)
    rows = pair_with_baseline(methods, baselines, on, how="left")
    rows["order"] = cell_order(rows).to_numpy()
    per_task, pooled_rows = [], []
    for key, group in rows.groupby(SETTING, dropna=False, sort=False):
        first = group.loc[group["order"].idxmin()]
        per_task.append((first["order"], {"cell": first["cell"], **dict(zip(SETTING, key)), "live": first["label"],
                                          **decomposition_row(group, include_disturbed)}))  # fmt: skip
    if rows["task"].nunique() > 1:
        setting = [name for name in SETTING if name != "task"]
        for key, group in rows.groupby(setting, dropna=False, sort=False):
            first = group.loc[group["order"].idxmin()]
            pooled_rows.append((first["order"], {"cell": "", **dict(zip(setting, key)), "task": ALL_TASKS, "live": first["label"],
                                                 **decomposition_row(group, include_disturbed)}))  # fmt: skip
    ordered = [row for _, row in sorted(per_task, key=lambda item: item[0])]
    ordered += [row for _, row in sorted(pooled_rows, key=lambda item: item[0])]
    return pd.DataFrame(ordered)[["cell", *SETTING, *[c for c in ordered[0] if c not in ("cell", *SETTING)]]]
