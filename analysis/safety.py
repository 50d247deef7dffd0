"""What a rule costs in safety, from the records of the safety tasks (rows whose ``safety`` holds a judge's
verdicts: ``task=harmful|jailbreak|injection|over_refusal``), and where in its answers it relaxed tokens.

A safety task's score of an answer is its scorer's measure (``refusal_rate``, ``attack_success``,
``injection_success``, ``over_refusal``: docs/tasks.md#safety), so a setting's rate is the mean score and its
safety change is its score change against the lossless autoregressive baseline on the same prompts (the answers
are paired by prompt: ``cells.paired``), with the paired bootstrap 95% CI and permutation p-value of
``bench.summary.score_change``. Every number here rests on the pairs that change counts
(``summary.changed_pairs``: both answers finished, or every scored pair with ``--include-cut``).

The first L tokens of an answer are its generated positions 0 .. L-1; a relaxed token is an accepted draft whose
reason is RELAXED (``records.relaxed_positions`` reads where they fall from the step trace). An exact-first window
of L (``exact_first=L``) keeps every one of an answer's first L tokens strict, so its share there is 0.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from mars_bench.bench.records import relaxed_positions
from mars_bench.bench.stats import bootstrap_mean_ci, wilson_interval
from mars_bench.bench.summary import PROMPT, changed_pairs, score_change, summarise_paired

from .cells import INCLUDE_CUT, SETTING, NotEnoughData, paired
from .fidelity import cost_per_token

FIRST_TOKENS = (1, 2, 4, 8, 16)  # the first-L windows by default
FIRST_TOKENS_OPTION = "--first-tokens"  # the analysis's option that sets them
NO_SAFETY = ("no method row carries a safety judge's verdicts (run a safety task: task=harmful, jailbreak, injection "
             "or over_refusal)")  # fmt: skip
KEYS = [*SETTING, "label"]
GROUPS = {"relaxed": "with a relaxed token in the first L", "strict": "with none there"}


def is_safety(value: object) -> bool:
    """Whether a record's ``safety`` field holds a judge's verdicts (a safety task's row)."""
    return isinstance(value, dict) and "verdicts" in value


def without_answer_text(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each safety task row's answer replaced by the SHA-256 of its text (``output_sha256``;
    ``output_text`` and ``output_ids`` emptied), for the gathered records the analysis writes: answers to harmful
    requests are data, kept in each run's own records.jsonl, not passed on with the tables. Other rows unchanged."""
    if "safety" not in frame or "output_text" not in frame:
        return frame
    rows = frame["safety"].map(is_safety)
    if not rows.any():
        return frame
    out = frame.copy()
    out["output_sha256"] = [hashlib.sha256(str(text).encode("utf-8")).hexdigest() if safety else None
                            for text, safety in zip(out["output_text"], rows)]  # fmt: skip
    out.loc[rows, "output_text"] = ""
    if "output_ids" in out:
        out["output_ids"] = [[] if safety else ids for ids, safety in zip(out["output_ids"], rows)]
    return out


def safety_pairs(frame: pd.DataFrame, include_cut: bool = False) -> pd.DataFrame:
    """The method rows of the safety tasks, one per setting and prompt, with their baseline's ``*_base`` columns,
    ``relaxed_positions`` (a list; None where the trace does not give them), ``refusal_kept`` (the judge-free
    measure: True, False, or None where the baseline did not refuse) and ``counted`` (in the score change)."""
    if "safety" not in frame or not frame["safety"].map(is_safety).any():
        raise NotEnoughData(NO_SAFETY)
    rows = paired(frame)
    rows = rows[rows["safety"].map(is_safety)]
    if rows.empty:
        raise NotEnoughData(NO_SAFETY)
    rows = rows.drop_duplicates(["run_dir", *KEYS, *PROMPT]).copy()
    rows["relaxed_positions"] = [relaxed_positions(row) for row in rows.to_dict("records")]
    rows["refusal_kept"] = [safety.get("refusal_kept") for safety in rows["safety"]]
    used, _cut = changed_pairs(rows, include_cut)
    rows["counted"] = rows.index.isin(used.index)
    return rows


def rate_and_base(rows: pd.DataFrame) -> dict[str, float]:
    """The mean score of ``rows`` and of their baselines (NaN for none)."""
    some = len(rows) > 0
    return {"rate": rows["score"].mean() if some else np.nan, "baseline_rate": rows["score_base"].mean() if some else np.nan}


def safety_table(pairs: pd.DataFrame, include_disturbed: bool = False, include_cut: bool = False) -> pd.DataFrame:
    """One row per setting of a safety task: its measure (the task's scorer) and judge; prompts; disturbed (prompts
    whose timing other processes disturbed: left out of the speedup unless ``include_disturbed``), speedup [CI] over
    the AR baseline, tau and the relaxed share (``summary.summarise_paired``); the live verifier's KL per generated
    token and deviation rate (``fidelity.cost_per_token``; NaN without fidelity=true); its ``rate`` and the
    baseline's ``baseline_rate`` on the pairs the change counts; ``change`` (rate - baseline_rate) with its paired
    bootstrap 95% CI and p-value, ``change_prompts`` (the pairs counted) and ``change_cut`` (pairs a cut answer left
    out, or with ``include_cut`` holds); ``refusal_kept`` of ``baseline_refused`` (counted pairs whose baseline
    refused: the method's answer opens with the baseline's refusal)."""
    out = []
    for key, rows in pairs.groupby(KEYS, dropna=False, sort=True):
        summary = summarise_paired(rows, include_disturbed, include_cut)
        change = score_change(rows, include_cut)
        counted = rows[rows["counted"]]
        kept = counted["refusal_kept"].dropna()
        out.append({**dict(zip(KEYS, key)), "measure": rows["scorer"].iloc[0], "judge": rows["judge"].iloc[0],
                    "prompts": len(rows), "disturbed": summary["disturbed"], "speedup": summary["speedup"],
                    "speedup_ci_low": summary["speedup_ci_low"], "speedup_ci_high": summary["speedup_ci_high"],
                    "tau": summary["tau"],
                    "relaxed_share": summary["relaxed_share"], **cost_per_token(rows), **rate_and_base(counted),
                    "change": change["score_change"], "change_ci_low": change["score_change_ci_low"],
                    "change_ci_high": change["score_change_ci_high"], "change_p": change["score_change_p"],
                    "change_prompts": change["score_change_prompts"], "change_cut": change["score_change_cut"],
                    "refusal_kept": int(sum(bool(value) for value in kept)), "baseline_refused": len(kept)})  # fmt: skip
    return pd.DataFrame(out)


def answer_table(pairs: pd.DataFrame, first_tokens: tuple[int, ...] = FIRST_TOKENS) -> pd.DataFrame:
    """One row per answer: its setting, prompt, measure, new tokens, whether it finished and is ``counted`` in the
    change, its score and its baseline's, ``relaxed_positions`` (space-separated; empty for none, ``?`` where the
    trace does not give them), ``first_relaxed`` (the first one, None for none) and ``relaxed_in_first_L`` for
    each L of ``first_tokens`` (how many of its first L tokens were relaxed), the first position where it
    differs from the baseline's answer and ``refusal_kept``."""
    table = pairs[[*KEYS, *PROMPT]].copy()
    table["measure"] = pairs["scorer"]
    for column in ("new_tokens", "finished", "counted", "score", "score_base"):
        table[column] = pairs[column]
    positions = pairs["relaxed_positions"]
    table["relaxed_positions"] = [" ".join(map(str, found)) if found is not None else "?" for found in positions]
    table["first_relaxed"] = pd.array([found[0] if found else None for found in positions], dtype="Int64")
    for length in first_tokens:
        table[f"relaxed_in_first_{length}"] = pd.array(
            [sum(position < length for position in found) if found is not None else None for found in positions],
            dtype="Int64")  # fmt: skip
    table["first_divergence"] = pd.array(pairs.get("first_divergence", pd.Series(None, index=pairs.index)), dtype="Int64")
    table["refusal_kept"] = pairs["refusal_kept"]
    return table.reset_index(drop=True)


def outcome(rows: pd.DataFrame, binary: bool) -> dict[str, float]:
    """The mean score of ``rows`` with its 95% interval (Wilson for 0/1 scores, else the bootstrap's), and the
    mean paired change against the baseline with its bootstrap 95% CI."""
    scores, differences = rows["score"], rows["score"] - rows["score_base"]
    if binary:
        low, high = wilson_interval(int(scores.sum()), len(scores))
    else:
        low, high = bootstrap_mean_ci(scores)
    change_low, change_high = bootstrap_mean_ci(differences)
    some = len(rows) > 0
    return {"rate": scores.mean() if some else np.nan, "rate_ci_low": low, "rate_ci_high": high,
            "change": differences.mean() if some else np.nan, "change_ci_low": change_low,
            "change_ci_high": change_high}  # fmt: skip


def first_tokens_table(pairs: pd.DataFrame, first_tokens: tuple[int, ...] = FIRST_TOKENS) -> pd.DataFrame:
    """Per setting and L of ``first_tokens``, over the answers the change counts whose relaxed positions the trace
    gives (``answers``; ``untraced``: counted answers it does not): ``tokens_first`` (their first L tokens, fewer
    where an answer is shorter), ``relaxed_first`` (those relaxed), ``relaxed_share_first`` (the one over the
    other) beside ``relaxed_share_all`` (relaxed tokens over all their tokens); then the answers with a relaxed
    token in their first L (``relaxed_answers``) and those with none there (``strict_answers``), each group's
    mean score (``relaxed_rate``, ``strict_rate``) with its 95% interval (``rate_interval``: Wilson where every
    score is 0 or 1, else bootstrap) and its mean paired change against the baseline with its bootstrap 95% CI
    (``relaxed_change``, ``strict_change``)."""
    counted = pairs[pairs["counted"]]
    if counted.empty:
        raise NotEnoughData("no safety answer is counted: every pair holds an answer cut at the token budget "
                            f"(raise max_new_tokens, or pass {INCLUDE_CUT})")  # fmt: skip
    out = []
    for key, rows in counted.groupby(KEYS, dropna=False, sort=True):
        traced = rows[rows["relaxed_positions"].notna()]
        positions = list(traced["relaxed_positions"])
        tokens = traced["new_tokens"].astype(int).to_numpy()
        binary = bool(rows["score"].isin([0, 1]).all())
        for length in first_tokens:
            within = np.array([sum(position < length for position in found) for found in positions], dtype=int)
            first = np.minimum(tokens, length).sum()
            relaxed = within > 0
            row = {**dict(zip(KEYS, key)), "measure": rows["scorer"].iloc[0], "first_tokens": length,
                   "answers": len(traced), "untraced": len(rows) - len(traced), "tokens_first": int(first),
                   "relaxed_first": int(within.sum()), "relaxed_share_first": within.sum() / first if first else np.nan,
                   "relaxed_share_all": sum(map(len, positions)) / tokens.sum() if tokens.sum() else np.nan,
                   "rate_interval": "wilson" if binary else "bootstrap"}  # fmt: skip
            for group, chosen in (("relaxed", traced[relaxed]), ("strict", traced[~relaxed])):
                row[f"{group}_answers"] = len(chosen)
                row |= {f"{group}_{name}": value for name, value in outcome(chosen, binary).items()}
            out.append(row)
    return pd.DataFrame(out)


def interval_text(value: float, low: float, high: float, pattern: str = "{:.2f}") -> str:
    """``0.50 [0.10, 0.90]``; the value alone where it has no interval, ``-`` where it has none."""
    if pd.isna(value):
        return "-"
    shown = pattern.format(value)
    return shown if pd.isna(low) else f"{shown} [{pattern.format(low)}, {pattern.format(high)}]"


def shown_first_tokens(table: pd.DataFrame) -> pd.DataFrame:
    """``first_tokens_table`` as its Markdown shows it: each estimate with its interval in one cell."""
    shown = table.drop(columns=[column for column in table if column.endswith(("_ci_low", "_ci_high"))])
    for group in GROUPS:
        for name, pattern in (("rate", "{:.2f}"), ("change", "{:+.2f}")):
            column = f"{group}_{name}"
            shown[column] = [interval_text(*values, pattern=pattern)
                             for values in zip(table[column], table[f"{column}_ci_low"], table[f"{column}_ci_high"])]  # fmt: skip
    return shown


def shown_safety(table: pd.DataFrame) -> pd.DataFrame:
    """``safety_table`` as its Markdown shows it: speedup and change each with its interval in one cell,
    ``refusal_kept`` as ``kept/refused``."""
    shown = table.drop(columns=["speedup_ci_low", "speedup_ci_high", "change_ci_low", "change_ci_high"])
    shown["speedup"] = [interval_text(*values, pattern="{:.2f}x")
                        for values in zip(table["speedup"], table["speedup_ci_low"], table["speedup_ci_high"])]  # fmt: skip
    shown["change"] = [interval_text(*values, pattern="{:+.3f}")
                       for values in zip(table["change"], table["change_ci_low"], table["change_ci_high"])]  # fmt: skip
    shown["refusal_kept"] = [f"{kept}/{refused}" if refused else "-"
                             for kept, refused in zip(table["refusal_kept"], table["baseline_refused"])]  # fmt: skip
    return shown.drop(columns="baseline_refused")


def parse_first_tokens(text: str) -> tuple[int, ...]:
    """The value of ``FIRST_TOKENS_OPTION``, ``1,2,4,8,16``, as sorted distinct lengths; a clear one-line error otherwise."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"{FIRST_TOKENS_OPTION} {text!r} is invalid: allowed are whole numbers of tokens above 0, separated by "
                         f"commas (default {','.join(map(str, FIRST_TOKENS))})")  # fmt: skip
    return tuple(sorted({int(part) for part in parts}))
