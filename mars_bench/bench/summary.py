"""The one summariser of records (torch-free: pandas only), for the end-of-run table and the analysis.

Method rows are paired with baseline rows of the same prompt; a paired set gives speed (the
throughput ratio with a paired bootstrap 95% CI, and the paper's mean-of-rates convention),
tau (pooled, and the mean of per-request values beside it), acceptance, the rate of each count
statistic the verifier declares (``rule_rates``: ``trigger_rate`` of ``mars``) and the score with its CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mars_bench.bench.records import BASELINE, BUDGET, OLD_RULE_FIELDS, rule_statistics
from mars_bench.bench.stats import (
    bootstrap_mean_ci,
    bootstrap_ratio_ci,
    mean_rate_ratio,
    paired_permutation_p,
    throughput_ratio,
)
from mars_bench.common.token_counts import emitted_tokens

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
    ok["finished"] = answer_finished(ok)
    return ok


def answer_finished(rows: pd.DataFrame) -> pd.Series:
    """Per row, whether its answer ended on a stop token or string (True) or was cut at the token budget
    (False): the record's ``finished``, else (rows of schema 9 and older) its ``stop_reason``; None where
    neither says."""
    reason = rows["stop_reason"] if "stop_reason" in rows else pd.Series("", index=rows.index)
    derived = [(value != BUDGET) if isinstance(value, str) and value else None for value in reason]
    recorded = rows["finished"] if "finished" in rows else pd.Series(None, index=rows.index)
    return pd.Series([bool(r) if r is not None and not pd.isna(r) else d for r, d in zip(recorded, derived)],
                     index=rows.index, dtype=object)  # fmt: skip


def cut_answers(finished: pd.Series) -> pd.Series:
    """Per row of a ``finished`` column: its answer was cut at the token budget (known, and not finished)."""
    return finished.map(lambda value: value is not None and not pd.isna(value) and not value).astype(bool)


def changed_pairs(pairs: pd.DataFrame, include_cut: bool = False) -> tuple[pd.DataFrame, pd.Series]:
    """The rows of ``pairs`` (method rows with ``score_base`` and ``finished_base``) that a score change counts:
    both scored, both answers finished (every scored pair with ``include_cut``); and, per scored pair, whether
    a cut answer is in it."""
    scored = pairs.dropna(subset=["score", "score_base"]) if "score_base" in pairs else pairs.iloc[:0]
    cut = cut_answers(scored["finished"]) | cut_answers(scored.get("finished_base", pd.Series(None, index=scored.index)))
    return (scored if include_cut else scored[~cut]), cut


def score_change(pairs: pd.DataFrame, include_cut: bool = False) -> dict[str, Any]:
    """A method's score minus its baseline's on the same prompts (``pairs``: method rows with ``score_base``
    and ``finished_base``), over the prompts ``changed_pairs`` counts: the mean difference with its paired
    bootstrap 95% CI and permutation p-value, how many prompts it rests on and how many pairs a cut answer
    left out (or, with ``include_cut``, holds)."""
    used, cut = changed_pairs(pairs, include_cut)
    differences = used["score"] - used["score_base"]
    low, high = bootstrap_mean_ci(differences)
    return {"score_change": differences.mean() if len(differences) else np.nan, "score_change_ci_low": low,
            "score_change_ci_high": high, "score_change_p": paired_permutation_p(differences) if len(differences) else np.nan,
            "score_change_prompts": len(used), "score_change_cut": int(cut.sum())}  # fmt: skip


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else np.nan


def tau_request_mean(rows: pd.DataFrame) -> float:
    """The mean over requests (rows: one decoded turn each) of each one's tau, its emitted tokens over its
    verification steps; rows without a step are left out, NaN where none has one. SpecForge reports tau
    so; ``tau`` here pools instead (all emitted tokens over all steps of the rows, as vLLM and SGLang
    do), which weighs a request by its steps. The two can order methods differently."""
    stepped = rows[rows["steps"] > 0]
    return float((stepped["emitted"] / stepped["steps"]).mean()) if len(stepped) else np.nan


RATE = "_rate"  # a count statistic's rate is the column ``<name>_rate``
PAIRED_RATES = ("acceptance_rate", "speedup_mean_rate")  # summarise_paired's own rates, which no statistic's may take


def rule_rates(rows: pd.DataFrame) -> dict[str, float]:
    """Per count statistic the rows' verifier declares (their ``rule_counts``), ``<name>_rate``: the verified
    positions where it happened over the verified positions of the rows that report it; none for a verifier
    that declares none. Every verifier's relaxed share is ``relaxed_share`` beside it."""
    if "rule_counts" not in rows:
        return {}
    counts = [value if isinstance(value, dict) else {} for value in rows["rule_counts"]]
    rates = {}
    for name in dict.fromkeys(name for found in counts for name in found):
        if name + RATE in PAIRED_RATES:
            raise ValueError(f"statistic {name!r} is invalid: its rate would be the column {name + RATE}, "
                             f"which the summary has already")  # fmt: skip
        having = [name in found for found in counts]
        counted = sum(found[name] for found in counts if name in found)
        rates[name + RATE] = ratio(counted, rows.loc[having, "verified_positions"].sum())
    return rates


def rule_rate_columns(table: pd.DataFrame) -> list[str]:
    """The columns of a summary table (``summarise``, or the analysis's per setting) that are ``rule_rates``."""
    return [column for column in table.columns if column.endswith(RATE) and column not in PAIRED_RATES]


def with_rule_statistics(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (rows as records hold them, of any schema) with ``rule_counts`` and ``rule_values`` as the current
    schema has them (``records.rule_statistics``, which reads older rows) and the older rows' fields for them gone."""
    found = [rule_statistics(row) for row in frame.to_dict("records")]
    frame = frame.drop(columns=[name for name in OLD_RULE_FIELDS if name in frame])
    frame["rule_counts"] = [counts for counts, _ in found]
    frame["rule_values"] = [values for _, values in found]
    return frame


def summarise_paired(rows: pd.DataFrame, include_disturbed: bool = False, include_cut: bool = False) -> dict[str, Any]:
    """Speed, acceptance and quality of one method's rows (one per prompt), with the columns ``*_base``
    of the baseline row of the same prompt (NaN where that baseline failed or is missing).

    The speedups use the prompts that have a baseline, less those where the method's or the
    baseline's timing was disturbed by other processes (``disturbed``: how many; kept with
    ``include_disturbed``); tok/s uses the rows whose own timing was not disturbed (all with
    ``include_disturbed``); everything else uses every row. The rate of each count statistic the verifier
    declares (``rule_rates``, from ``rule_counts``) follows ``relaxed_share``; a verifier without any has none.
    ``finished`` counts the answers that ended on a stop (of ``answers`` whose ending is known), ``scored_cut``
    the scored answers cut at the token budget (a score over them measures the budget too); the score change
    against the baseline (``score_change``) uses the prompts where both answers finished, or with
    ``include_cut`` every scored pair (``score_change_cut``: the pairs a cut answer left out, or counted).
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
    ending = rows["finished"].dropna()
    scored_cut = int(cut_answers(rows.loc[rows["score"].notna(), "finished"]).sum()) if "score" in rows else 0
    score_low, score_high = bootstrap_mean_ci(scores)
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
        **rule_rates(rows),
        "agreement": rows["agreement"].mean() if "agreement" in rows and rows["agreement"].notna().any() else np.nan,
        "score": scores.mean() if len(scores) else np.nan,
        "score_ci_low": score_low,
        "score_ci_high": score_high,
        "answers": len(ending),
        "finished": int(sum(bool(value) for value in ending)),
        "scored_cut": scored_cut,
        **score_change(rows, include_cut),
    }


def pair_with_baseline(methods: pd.DataFrame, baselines: pd.DataFrame, on: list[str], how: str = "inner") -> pd.DataFrame:
    """``methods`` with the ``new_tokens``, ``seconds``, ``latency_s``, ``score`` and ``finished`` of the baseline row
    of the same ``on`` keys
    (``*_base``): only the rows that have one (``how="inner"``), or every row (``"left"``, NaN where none)."""
    quality = [column for column in ("score", "finished") if column in baselines]
    base = baselines[[*on, "new_tokens", "seconds", "latency_s", "disturbed", *quality]]
    return methods.merge(base, on=on, suffixes=("", "_base"), how=how)


TERMINAL = ["cell", "method", "verifier", "verifier_setting", "prompts", "disturbed", "tokens", "tok_per_s", "speedup",
            "speedup_ci_low", "speedup_ci_high", "speedup_mean_rate", "speedup_note", "tau", "tau_request_mean", "relaxed",
            "agreement", "score", "score_ci_low", "score_ci_high", "answers", "finished", "scored_cut",
            "score_change", "score_change_ci_low", "score_change_ci_high", "score_change_p", "score_change_prompts",
            "score_change_cut", "batch_size", "latency_mean_s", "latency_p50_s", "latency_p90_s", "latency_speedup"]  # fmt: skip
# (summarise puts the verifiers' rule_rates after relaxed)
CUT_MARK = "†"  # marks a score over answers cut at the token budget; cut_note says what it means


def finished_text(finished: Any, answers: Any) -> str:
    """``8/10`` (answers that ended on a stop of those whose ending is known); ``-`` where none is known."""
    return f"{int(finished)}/{int(answers)}" if answers and not pd.isna(answers) else "-"


def marked_score(score: Any, scored_cut: Any, pattern: str = "{:.3f}") -> str:
    """A score as the tables show it: with ``CUT_MARK`` and how many answers were cut where it rests on some."""
    if score is None or pd.isna(score):
        return "-"
    cut = int(scored_cut) if scored_cut is not None and not pd.isna(scored_cut) else 0
    return pattern.format(score) + (f" ({cut} cut{CUT_MARK})" if cut else "")


def cut_note(include_cut: bool = False, option: str = "include_cut=true") -> str:
    """The footnote under a table with a score over cut answers."""
    counted = (f"the score changes count them too ({option})" if include_cut
               else f"score changes leave out every prompt where either answer was cut ({option} counts them)")  # fmt: skip
    return (f"{CUT_MARK} cut: answers that reached max_new_tokens before a stop token or string; a score over them "
            f"measures the token budget as much as the model (raise max_new_tokens); {counted}.")


def change_text(row: dict[str, Any]) -> str:
    """``-0.100 [-0.300, 0.100] (9 prompts, 1 cut)``: a method's score change against its baseline."""
    change = row.get("score_change")
    if change is None or pd.isna(change):
        return "-"
    cut = int(row.get("score_change_cut") or 0)
    return (f"{change:+.3f} [{row['score_change_ci_low']:+.3f}, {row['score_change_ci_high']:+.3f}] "
            f"({int(row['score_change_prompts'])} prompts" + (f", {cut} cut{CUT_MARK})" if cut else ")"))
RUN_OPTION = "include_disturbed=true"  # how the app is told to count disturbed rows (the analysis: --include-disturbed)


def disturbed_reason(count: int | None = None, option: str = RUN_OPTION) -> str:
    """Why there is no speedup: the timing of every one of the ``count`` prompts (``None``: of every
    prompt) was disturbed, the method's row or its baseline's (the ``disturbed`` column counts them)."""
    prompts = "every prompt was" if count is None else ("its 1 prompt was" if count == 1 else f"all {count} prompts were")
    return f"{prompts} disturbed; rerun on an idle machine, or pass `{option}`"


def speedup_note(speedup: float, disturbed: int, option: str = RUN_OPTION) -> str:
    """What a summary says where a speedup is missing (empty where there is one): the timing of every
    paired prompt was disturbed (``disturbed`` of them; speedups leave them out unless ``option`` counts
    them), or no prompt has a decoded baseline row (an accuracy_only run decodes none)."""
    if pd.notna(speedup):
        return ""
    if disturbed:
        return f"no speedup: {disturbed_reason(int(disturbed), option)}"
    return "no speedup: no prompt has a decoded baseline row (experiment=accuracy decodes none)"


def speedup_notes(summary: pd.DataFrame, option: str = RUN_OPTION) -> list[str]:
    """``speedup_note`` of every row of a summary table (columns ``speedup`` and ``disturbed``)."""
    return [speedup_note(speedup, disturbed, option) for speedup, disturbed in zip(summary["speedup"], summary["disturbed"])]


def summarise(rows: list[dict[str, Any]], include_disturbed: bool = False, include_cut: bool = False) -> pd.DataFrame:
    """One row per (cell, method) of a run's records. Prompts pair on (question_id, turn) within a cell;
    the baseline pairs with itself (speedup 1, agreement 1)."""
    frame = pd.DataFrame(rows)
    if frame.empty or "status" not in frame or not (frame["status"] == "ok").any():
        return pd.DataFrame()
    frame = finished(with_rule_statistics(frame))
    out = []
    for cell, cell_rows in frame.groupby("cell", sort=False):
        base = cell_rows[cell_rows["method"] == BASELINE]
        for method, group in cell_rows.groupby("method", sort=False):
            summary = summarise_paired(pair_with_baseline(group, base, PROMPT, how="left"), include_disturbed, include_cut)
            if method == BASELINE:  # compared with itself: no change to report
                summary |= {"agreement": 1.0, "score_change": np.nan, "score_change_ci_low": np.nan,
                            "score_change_ci_high": np.nan, "score_change_p": np.nan}  # fmt: skip
            setting = {"verifier": BASELINE, "verifier_setting": ""} if method == BASELINE else {
                "verifier": group["verifier"].iloc[0], "verifier_setting": recorded_setting(group)}  # fmt: skip
            sizes = group["batch_size"].dropna() if "batch_size" in group else []  # rows of schema 7 and older: 1
            batch_size = int(sizes.iloc[0]) if len(sizes) else 1
            out.append({"cell": cell, "method": method, **setting, **summary, "batch_size": batch_size})
    table = pd.DataFrame(out)
    table["speedup_note"] = speedup_notes(table)
    at = TERMINAL.index("relaxed") + 1
    return table[[*TERMINAL[:at], *rule_rate_columns(table), *TERMINAL[at:]]]


def recorded_setting(rows: pd.DataFrame) -> str:
    """The verifier's settings of a method's rows (``key=value,...``, as they recorded them); empty where rows of
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


def format_table(summary: pd.DataFrame, disturbed: list[str] = (), included: bool = False, include_cut: bool = False) -> str:
    """A Markdown table for the terminal; then ``disturbed`` (the names of the rows other processes
    disturbed, from ``disturbed_rows``) with whether the speedups count them (``included``). The
    table's ``disturbed`` column counts the prompts each speedup leaves out (counts, with
    ``include_disturbed``); a missing speedup gives its reason in its place (``speedup_note``). ``finished``
    counts the answers that ended on a stop; a score over cut answers is marked (``cut_note``), and a method's
    score change against its baseline counts the prompts where both finished (all with ``include_cut``). The
    rates of the verifiers' count statistics share one column (``trigger 0.266``; ``-`` for a verifier without)."""
    if summary.empty:
        return "no finished rows to summarise"
    lines = [
        "| cell | method | prompts | disturbed | tok/s | speedup [95% CI] | speedup (mean of rates) "
        "| tau | tau (mean per request) | rule statistics (rate) | agreement | finished | score "
        "| score change vs baseline [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, pattern: str = "{:.2f}") -> str:
        return "-" if value is None or pd.isna(value) else pattern.format(value)

    rates = rule_rate_columns(summary)

    def rule_text(row: dict[str, Any]) -> str:
        shown = [f"{column.removesuffix(RATE)} {fmt(row[column], '{:.3f}')}" for column in rates if pd.notna(row[column])]
        return ", ".join(shown) or "-"

    for row in summary.to_dict("records"):
        ci = row.get("speedup_note") or f"{fmt(row['speedup'])}x [{fmt(row['speedup_ci_low'])}, {fmt(row['speedup_ci_high'])}]"
        lines.append(
            f"| {row['cell']} | {row['method']} | {row['prompts']} | {row['disturbed']} | {fmt(row['tok_per_s'])} | {ci} | "
            f"{fmt(row['speedup_mean_rate'], '{:.2f}x')} | {fmt(row['tau'])} | {fmt(row['tau_request_mean'])} | "
            f"{rule_text(row)} | {fmt(row['agreement'], '{:.3f}')} | "
            f"{finished_text(row['finished'], row['answers'])} | {marked_score(row['score'], row['scored_cut'])} | "
            f"{change_text(row)} |"
        )
    if "batch_size" in summary and (summary["batch_size"] > 1).any():
        lines += ["", "Decoded in batches: throughput above is each batch's tokens over its wall time; per request:", "",
                  "| cell | method | batch size | latency mean (s) | p50 (s) | p90 (s) | latency speedup |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {row['cell']} | {row['method']} | {row['batch_size']} | {fmt(row['latency_mean_s'])} | "
                  f"{fmt(row['latency_p50_s'])} | {fmt(row['latency_p90_s'])} | {fmt(row['latency_speedup'], '{:.2f}x')} |"
                  for row in summary.to_dict("records")]  # fmt: skip
    if (summary["scored_cut"] > 0).any() or (summary["score_change_cut"] > 0).any():
        lines += ["", cut_note(include_cut)]
    if disturbed:
        lines += ["", disturbed_note(list(disturbed), included)]
    return "\n".join(lines)


def write_summary(rows: list[dict[str, Any]], folder: Path, include_disturbed: bool = False, include_cut: bool = False) -> str:
    summary = summarise(rows, include_disturbed, include_cut)
    summary.to_csv(folder / SUMMARY_FILE, index=False)
    return format_table(summary, disturbed_rows(pd.DataFrame(rows)), include_disturbed, include_cut)
