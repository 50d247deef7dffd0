"""The one summariser of records (torch-free: pandas only), for the end-of-run table and the analysis.

Method rows are paired with baseline rows of the same prompt; a paired set gives speed (the
throughput ratio with a paired bootstrap 95% CI, and the paper's mean-of-rates convention),
tau (pooled, and the mean of per-request values beside it), acceptance, the verifier's own
trigger rate and the score with its CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mars_bench.bench.records import BASELINE
from mars_bench.bench.stats import bootstrap_mean_ci, bootstrap_ratio_ci, mean_rate_ratio, throughput_ratio
from mars_bench.token_counts import emitted_tokens

PROMPT = ["question_id", "turn"]
SUMMARY_FILE = "summary.csv"  # a cell's folder holds it once the cell has run to its end


def finished(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows that decoded successfully, with ``seconds`` (the row's share of its batch's wall time,
    ``batch_s / batch_rows``: prefill + decode for a row decoded alone), ``latency_s`` (prefill + decode:
    from its batch's start to its last token), ``emitted`` (tokens after the prefill's, the ones
    verification steps produced) and ``disturbed`` (False for rows written before contention was measured).

    So a throughput over rows (their new tokens over their seconds) is, for whole batches, the batch's
    tokens over its wall time, at any batch size."""
    ok = frame[frame["status"] == "ok"].copy() if "status" in frame else frame.copy()
    ok["latency_s"] = ok["prefill_s"] + ok["decode_s"]
    ok["seconds"] = ok["latency_s"]
    if "batch_s" in ok:  # rows of schema 8 on
        batched = ok["batch_s"].notna() & (ok["batch_s"] > 0)
        ok.loc[batched, "seconds"] = ok.loc[batched, "batch_s"] / ok.loc[batched, "batch_rows"]
    ok["emitted"] = emitted_tokens(ok["new_tokens"])
    ok["disturbed"] = ok["disturbed"].fillna(False).astype(bool) if "disturbed" in ok else False
    return ok


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else np.nan


def tau_request_mean(rows: pd.DataFrame) -> float:
    """The mean over requests (rows: one decoded turn each) of each one's tau, its emitted tokens over its
    verification steps; rows without a step are left out, NaN where none has one. SpecForge reports tau
    so; ``tau`` here pools instead (all emitted tokens over all steps of the rows, as vLLM and SGLang
    do), which weighs a request by its steps. The two can order methods differently."""
    stepped = rows[rows["steps"] > 0]
    return float((stepped["emitted"] / stepped["steps"]).mean()) if len(stepped) else np.nan


def summarise_paired(rows: pd.DataFrame, include_disturbed: bool = False) -> dict[str, Any]:
    """Speed, acceptance and quality of one method's rows (one per prompt), with the columns ``*_base``
    of the baseline row of the same prompt (NaN where that baseline failed or is missing).

    The speedups use the prompts that have a baseline, less those where the method's or the
    baseline's timing was disturbed by other processes (``disturbed``: how many; kept with
    ``include_disturbed``); tok/s uses the rows whose own timing was not disturbed (all with
    ``include_disturbed``); everything else uses every row. trigger_rate counts the rows whose
    verifier reports a trigger (``trigger_count`` not null): NaN for a verifier without one.
    """
    pairs = rows.dropna(subset=["seconds_base"])
    disturbed = pairs["disturbed"] | pairs["disturbed_base"].fillna(False).astype(bool)
    timed = rows
    if not include_disturbed:
        pairs = pairs[~disturbed]
        timed = rows[~rows["disturbed"]]
    speed = (pairs["new_tokens"], pairs["seconds"], pairs["new_tokens_base"], pairs["seconds_base"])
    some = len(pairs) > 0
    low, high = bootstrap_ratio_ci(*speed) if some else (np.nan, np.nan)
    latency = timed["latency_s"]
    scores = rows["score"].dropna() if "score" in rows else pd.Series(dtype=float)
    score_low, score_high = bootstrap_mean_ci(scores)
    counted = rows[rows["trigger_count"].notna()] if "trigger_count" in rows else rows.iloc[:0]
    accepted = rows["accepted"].sum()
    return {
        "prompts": len(rows),
        "disturbed": int(disturbed.sum()),
        "tokens": int(rows["new_tokens"].sum()),
        "tok_per_s": ratio(timed["new_tokens"].sum(), timed["seconds"].sum()),
        "speedup": throughput_ratio(*speed) if some else np.nan,
        "speedup_ci_low": low,
        "speedup_ci_high": high,
        "speedup_mean_rate": mean_rate_ratio(*speed) if some else np.nan,
        "latency_mean_s": latency.mean() if len(latency) else np.nan,
        "latency_p50_s": latency.quantile(0.5) if len(latency) else np.nan,
        "latency_p90_s": latency.quantile(0.9) if len(latency) else np.nan,
        # the baseline's mean per-request latency over the method's, on the same prompts
        "latency_speedup": ratio(pairs["latency_s_base"].mean(), pairs["latency_s"].mean()) if some else np.nan,
        "tau": ratio(rows["emitted"].sum(), rows["steps"].sum()),
        "tau_request_mean": tau_request_mean(rows),
        "acceptance_rate": ratio(accepted, rows["drafted"].sum()),
        "relaxed": int(rows["relaxed"].sum()),
        "relaxed_share": ratio(rows["relaxed"].sum(), accepted),
        "trigger_rate": ratio(counted["trigger_count"].sum(), counted["verified_positions"].sum()) if len(counted) else np.nan,
        "agreement": rows["agreement"].mean() if "agreement" in rows and rows["agreement"].notna().any() else np.nan,
        "score": scores.mean() if len(scores) else np.nan,
        "score_ci_low": score_low,
        "score_ci_high": score_high,
    }


def pair_with_baseline(methods: pd.DataFrame, baselines: pd.DataFrame, on: list[str], how: str = "inner") -> pd.DataFrame:
    """``methods`` with the ``new_tokens``, ``seconds`` and ``latency_s`` of the baseline row of the same ``on`` keys
    (``*_base``): only the rows that have one (``how="inner"``), or every row (``"left"``, NaN where none)."""
    base = baselines[[*on, "new_tokens", "seconds", "latency_s", "disturbed"]]
    return methods.merge(base, on=on, suffixes=("", "_base"), how=how)


TERMINAL = ["cell", "method", "verifier", "verifier_setting", "prompts", "disturbed", "tokens", "tok_per_s", "speedup",
            "speedup_ci_low", "speedup_ci_high", "speedup_mean_rate", "speedup_note", "tau", "tau_request_mean", "relaxed",
            "trigger_rate", "agreement", "score", "batch_size", "latency_mean_s", "latency_p50_s", "latency_p90_s",
            "latency_speedup"]  # fmt: skip
RUN_OPTION = "include_disturbed=true"  # how the app is told to count disturbed rows (the analysis: --include-disturbed)


def disturbed_reason(count: int | None = None, option: str = RUN_OPTION) -> str:
    """Why there is no speedup: the timing of every one of the ``count`` prompts (``None``: of every
    prompt) was disturbed, the method's row or its baseline's (the ``disturbed`` column counts them)."""
    prompts = "every prompt was" if count is None else ("its 1 prompt was" if count == 1 else f"all {count} prompts were")
    return f"{prompts} disturbed; rerun on an idle machine, or pass `{option}`"


def speedup_note(speedup: float, disturbed: int, option: str = RUN_OPTION) -> str:
    """What a summary says where a speedup is missing (empty where there is one): the timing of every
    paired prompt was disturbed (``disturbed`` of them; speedups leave them out unless ``option`` counts
    them), or no prompt has a finished baseline row."""
    if pd.notna(speedup):
        return ""
    if disturbed:
        return f"no speedup: {disturbed_reason(int(disturbed), option)}"
    return "no speedup: no prompt has a finished baseline row"


def speedup_notes(summary: pd.DataFrame, option: str = RUN_OPTION) -> list[str]:
    """``speedup_note`` of every row of a summary table (columns ``speedup`` and ``disturbed``)."""
    return [speedup_note(speedup, disturbed, option) for speedup, disturbed in zip(summary["speedup"], summary["disturbed"])]


def summarise(rows: list[dict[str, Any]], include_disturbed: bool = False) -> pd.DataFrame:
    """One row per (cell, method) of a run's records. Prompts pair on (question_id, turn) within a cell;
    the baseline pairs with itself (speedup 1, agreement 1)."""
    frame = pd.DataFrame(rows)
    if frame.empty or "status" not in frame or not (frame["status"] == "ok").any():
        return pd.DataFrame()
    frame = finished(frame)
    out = []
    for cell, cell_rows in frame.groupby("cell", sort=False):
        base = cell_rows[cell_rows["method"] == BASELINE]
        for method, group in cell_rows.groupby("method", sort=False):
            summary = summarise_paired(pair_with_baseline(group, base, PROMPT, how="left"), include_disturbed)
            if method == BASELINE:
                summary |= {"agreement": 1.0, "trigger_rate": np.nan}
            setting = {"verifier": BASELINE, "verifier_setting": ""} if method == BASELINE else {
                "verifier": group["verifier"].iloc[0], "verifier_setting": recorded_setting(group)}  # fmt: skip
            sizes = group["batch_size"].dropna() if "batch_size" in group else []  # rows of schema 7 and older: 1
            batch_size = int(sizes.iloc[0]) if len(sizes) else 1
            out.append({"cell": cell, "method": method, **setting, **summary, "batch_size": batch_size})
    table = pd.DataFrame(out)
    table["speedup_note"] = speedup_notes(table)
    return table[TERMINAL]


def recorded_setting(rows: pd.DataFrame) -> str:
    """The verifier's settings of a method's rows (``theta=0.9,guard=never,...``); empty where rows of
    an older writer (a resumed run) carry none."""
    settings = rows["verifier_setting"].dropna() if "verifier_setting" in rows else rows.iloc[:0]
    return str(settings.iloc[0]) if len(settings) else ""


def disturbed_rows(frame: pd.DataFrame) -> list[str]:
    """One name per finished row whose timing other processes disturbed, in record order:
    ``task question Q turn T · method: L other cores``, led by the cell where there are several."""
    if frame.empty or "disturbed" not in frame:
        return []
    ok = finished(frame)
    several_cells = "cell" in ok and ok["cell"].nunique() > 1
    names = []
    for row in ok[ok["disturbed"]].to_dict("records"):
        load = row.get("other_load")
        names.append((f"{row['cell']} · " if several_cells else "")
                     + f"{row.get('task', '?')} question {row['question_id']} turn {row['turn']} · {row['method']}"
                     + (f": {load:.2f} other cores" if load is not None and pd.notna(load) else ""))  # fmt: skip
    return names


def disturbed_note(names: list[str], included: bool, option: str = RUN_OPTION, limit: int = 20) -> str:
    """What a report says about the disturbed rows ``names``: how many, how the speedups treat them
    (``included``: counted, as ``option`` asked) and the first ``limit`` of them by name."""
    treatment = f"counted in the speedups ({option})" if included else (
        f"left out of the speedups with their prompts ({option} counts them; "
        "retry_disturbed=N re-times them once the machine is idle)"
    )  # fmt: skip
    shown = [f"- {name}" for name in names[:limit]] + ([f"- ... and {len(names) - limit} more"] if len(names) > limit else [])
    count = f"{len(names)} row was" if len(names) == 1 else f"{len(names)} rows were"
    return "\n".join([f"{count} timed while other processes used the machine (disturbed), {treatment}:", *shown])


def format_table(summary: pd.DataFrame, disturbed: list[str] = (), included: bool = False) -> str:
    """A Markdown table for the terminal; then ``disturbed`` (the names of the rows other processes
    disturbed, from ``disturbed_rows``) with whether the speedups count them (``included``). The
    table's ``disturbed`` column counts the prompts each speedup leaves out (counts, with
    ``include_disturbed``); a missing speedup gives its reason in its place (``speedup_note``)."""
    if summary.empty:
        return "no finished rows to summarise"
    lines = [
        "| cell | method | prompts | disturbed | tok/s | speedup [95% CI] | speedup (mean of rates) "
        "| tau | tau (mean per request) | trigger rate | agreement | score |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, pattern: str = "{:.2f}") -> str:
        return "-" if value is None or pd.isna(value) else pattern.format(value)

    for row in summary.to_dict("records"):
        ci = row.get("speedup_note") or f"{fmt(row['speedup'])}x [{fmt(row['speedup_ci_low'])}, {fmt(row['speedup_ci_high'])}]"
        lines.append(
            f"| {row['cell']} | {row['method']} | {row['prompts']} | {row['disturbed']} | {fmt(row['tok_per_s'])} | {ci} | "
            f"{fmt(row['speedup_mean_rate'], '{:.2f}x')} | {fmt(row['tau'])} | {fmt(row['tau_request_mean'])} | "
            f"{fmt(row['trigger_rate'], '{:.3f}')} | {fmt(row['agreement'], '{:.3f}')} | {fmt(row['score'], '{:.3f}')} |"
        )
    if "batch_size" in summary and (summary["batch_size"] > 1).any():
        lines += ["", "Decoded in batches: throughput above is each batch's tokens over its wall time; per request:", "",
                  "| cell | method | batch size | latency mean (s) | p50 (s) | p90 (s) | latency speedup |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {row['cell']} | {row['method']} | {row['batch_size']} | {fmt(row['latency_mean_s'])} | "
                  f"{fmt(row['latency_p50_s'])} | {fmt(row['latency_p90_s'])} | {fmt(row['latency_speedup'], '{:.2f}x')} |"
                  for row in summary.to_dict("records")]  # fmt: skip
    if disturbed:
        lines += ["", disturbed_note(list(disturbed), included)]
    return "\n".join(lines)


def write_summary(rows: list[dict[str, Any]], folder: Path, include_disturbed: bool = False) -> str:
    summary = summarise(rows, include_disturbed)
    summary.to_csv(folder / SUMMARY_FILE, index=False)
    return format_table(summary, disturbed_rows(pd.DataFrame(rows)), include_disturbed)
