"""Per-setting numbers that every table and figure shares.

A setting is (model, drafter, draft length, task, temperature, verifier, verifier setting, conditions):
the verifier's recorded settings split its cells, whichever settings it has. Its method rows are paired
with the baseline row of the same run folder, prompt and baseline conditions
(``records.BASELINE_CONDITIONS``); several runs of one setting (a sweep sharded over machines, a run
continued in another folder) pool their prompts; a resumed run is one folder.
Folders that measured the same prompt of a setting twice pool only when asked (analysis/runs.py).
The numbers themselves come from the one summariser of records, ``mars_bench.bench.summary``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mars_bench.bench.records import BASELINE, BASELINE_CONDITIONS
from mars_bench.bench.summary import (
    PROMPT,
    disturbed_reason,
    finished,
    pair_with_baseline,
    rule_rate_columns,
    speedup_notes,
    summarise_paired,
)
from mars_bench.common.settings import parse_setting

MISSING = object()  # a key one setting of a name has and another lacks
SETTING = ["model", "drafter", "draft_length", "task", "temperature", "verifier", "verifier_setting", "conditions"]
BASELINE_IDENTITY = ["model", *BASELINE_CONDITIONS]  # rows that agree on these and on the prompt have one baseline
INCLUDE_DISTURBED = "--include-disturbed"  # the analysis's option that counts disturbed rows in the speedups
INCLUDE_CUT = "--include-cut"  # the analysis's option that counts cut answers in the score changes


class NotEnoughData(ValueError):
    """A table or figure cannot be made from these records; the message says what is missing."""


def recorded_setting(setting: object) -> dict[str, Any]:
    """A recorded ``verifier_setting`` (``key=value,...``) as values by key; empty for none (or a row
    that carries none)."""
    return parse_setting(setting) if isinstance(setting, str) else {}


def varying_settings(names: pd.Series | list[str], settings: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per name (a verifier), the keys whose values differ between the settings recorded with it, in the
    order they first appear (a key one setting has and another lacks differs too); none for a name run with
    one setting."""
    varying: dict[str, list[str]] = {}
    for name in dict.fromkeys(names):
        mine = [p for n, p in zip(names, settings) if n == name]
        keys = dict.fromkeys(k for p in mine for k in p)
        varying[name] = [k for k in keys if len({p.get(k, MISSING) for p in mine}) > 1]
    return varying


def varying_labels(names: pd.Series, settings: list[dict[str, Any]]) -> pd.Series:
    """``name (key=value, ...)`` with the keys whose values differ between the settings of the same
    name (a sweep of one setting: ``name (key=0.84)``); a name run with one setting keeps its bare name."""
    varying = varying_settings(names, settings)
    labels = []
    for name, setting in zip(names, settings):
        shown = [f"{k}={v}" for k, v in setting.items() if k in varying[name]]
        labels.append(f"{name} ({', '.join(shown)})" if shown else name)
    return pd.Series(labels, index=names.index, dtype=object)


def method_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished rows of the verifiers (not the baselines), one per setting and prompt, labelled
    with the verifier's setting where it varies, the draft-length policy where it is not fixed and
    the baseline conditions where they vary (gather.name_conditions)."""
    ok = finished(frame)
    rows = ok[ok["method"] != BASELINE].copy()
    if rows.empty:
        raise NotEnoughData("no finished method rows (only baselines or failures)")
    labels = varying_labels(rows["verifier"], [recorded_setting(s) for s in rows["verifier_setting"]])
    lengths = [f"{length} length" if length != "fixed" else "" for length in rows["draft_length"]]
    rows["label"] = [", ".join(filter(None, parts)) for parts in zip(labels, lengths, rows["conditions"])]
    return rows


def baseline_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished baseline rows, one per baseline identity and prompt: cells of a sweep share them."""
    ok = finished(frame)
    base = ok[ok["method"] == BASELINE]
    return base.drop_duplicates([*BASELINE_IDENTITY, *PROMPT])


def paired(frame: pd.DataFrame) -> pd.DataFrame:
    """Method rows with the baseline of their own run folder, baseline identity and prompt (columns ``*_base``,
    NaN where a prompt has none: an ``accuracy_only`` run has scores and no speed)."""
    ok = finished(frame)
    keys = ["run_dir", *BASELINE_IDENTITY, *PROMPT]
    return pair_with_baseline(method_rows(frame), ok[ok["method"] == BASELINE], keys, how="left")


def method_summary(frame: pd.DataFrame, include_disturbed: bool = False, include_cut: bool = False) -> pd.DataFrame:
    """One row per setting: prompts, run_folders (how many run folders they came from: analysis/runs.py),
    disturbed (the prompts whose timing other processes disturbed: left out of the speedup, counted in
    it with ``include_disturbed``), speedup [CI] and, where it is missing, ``speedup_note`` (why), tau,
    acceptance, the rate of each count statistic its verifier declares (``summary.rule_rates``), score [CI].
    ``finished`` of ``answers`` ended on a stop (``finished_share``);
    the score change against the baseline counts the prompts where both answers finished (every one with
    ``include_cut``). Beside ``verifier``, a column per setting that differs between the cells of a verifier
    (``setting_columns``)."""
    pairs = paired(frame)
    out = []
    for key, rows in pairs.groupby(SETTING, dropna=False, sort=True):
        rows = rows.drop_duplicates(["run_dir", *PROMPT])
        summary = summarise_paired(rows, include_disturbed, include_cut)
        summary["finished_share"] = summary["finished"] / summary["answers"] if summary["answers"] else float("nan")
        out.append({**dict(zip(SETTING, key)), "label": rows["label"].iloc[0], "prompts": summary.pop("prompts"),
                    "run_folders": rows["run_dir"].nunique(), **summary})  # fmt: skip
    table = pd.DataFrame(out)
    summary = setting_columns(after(table, "relaxed_share", rule_rate_columns(table)))
    summary.insert(summary.columns.get_loc("speedup_mean_rate") + 1, "speedup_note", speedup_notes(summary, INCLUDE_DISTURBED))
    return summary


def after(table: pd.DataFrame, column: str, moved: list[str]) -> pd.DataFrame:
    """``table`` with the columns ``moved`` right after ``column`` (settings that declare different statistics
    leave each statistic's rate wherever its first row put it)."""
    rest = [name for name in table.columns if name not in moved]
    at = rest.index(column) + 1
    return table[[*rest[:at], *moved, *rest[at:]]]


def setting_columns(summary: pd.DataFrame) -> pd.DataFrame:
    """``summary`` with a column after ``verifier`` for each setting that differs between the cells of a
    verifier, named by the setting as its verifier records it: every row's value of it (None where the row's
    verifier has no such setting). A setting named like a column the table has already is left to the labels."""
    settings = [recorded_setting(setting) for setting in summary["verifier_setting"]]
    varying = varying_settings(list(summary["verifier"]), settings)
    keys = [key for key in dict.fromkeys(k for keys in varying.values() for k in keys) if key not in summary.columns]
    at = summary.columns.get_loc("verifier") + 1
    for offset, key in enumerate(keys):
        summary.insert(at + offset, key, pd.Series([setting.get(key) for setting in settings], index=summary.index, dtype=object))
    return summary


def is_number(value: object) -> bool:
    """Whether a recorded setting's value is a finite number (not a bool, None or text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Sweep:
    """A verifier whose cells differ in one setting only, a number in two or more of them: what the
    threshold ablation draws its metrics against."""

    verifier: str  # the verifier's name
    setting: str  # the setting's name, as the verifier records it

    @property
    def axis(self) -> str:
        """The x axis's label: ``verifier: setting``."""
        return f"{self.verifier}: {self.setting}"

    def values(self, table: pd.DataFrame) -> pd.Series:
        """The setting's value in each row of ``table`` (one with ``verifier`` and ``verifier_setting``), as
        a float; NaN in rows of other verifiers and where the value is no number (None: a setting off)."""
        values = [recorded_setting(setting).get(self.setting) if verifier == self.verifier else None
                  for verifier, setting in zip(table["verifier"], table["verifier_setting"])]  # fmt: skip
        return pd.Series([float(v) if is_number(v) else np.nan for v in values], index=table.index, dtype=float)


def setting_sweeps(summary: pd.DataFrame) -> list[Sweep]:
    """The sweeps among the settings of ``summary`` (method_summary's table), by verifier name: each verifier
    whose cells differ in exactly one setting, which is a number in two or more distinct values."""
    settings = [recorded_setting(setting) for setting in summary["verifier_setting"]]
    sweeps = []
    for verifier, keys in sorted(varying_settings(list(summary["verifier"]), settings).items()):
        if len(keys) == 1:
            sweep = Sweep(verifier, keys[0])
            if sweep.values(summary).nunique() >= 2:
                sweeps.append(sweep)
    return sweeps


def setting_name(row: pd.Series) -> str:
    """A setting (a row of method_summary's table, or a method row) as index.md and the errors name it:
    ``rejection on humaneval (qwen2.5-coder-1.5b, model, T=1)``."""
    return f"{row['label']} on {row['task']} ({row['model']}, {row['drafter']}, T={row['temperature']:g})"


def missing_speedups(summary: pd.DataFrame) -> str | None:
    """One sentence for the settings of ``summary`` (method_summary's table) that have no speedup, if any:
    the reason where it is that every paired row was disturbed, else where each one's reason is."""
    missing = summary[summary["speedup"].isna()]
    if missing.empty:
        return None
    some = f"{len(missing)} of the {len(summary)} settings" if len(missing) < len(summary) else "any setting"
    which = f"no speedup in {some}"
    if (missing["disturbed"] > 0).all():
        return f"{which}: {disturbed_reason(option=INCLUDE_DISTURBED)}"
    return f"{which}: the settings table gives each one's reason in its speedup column"
