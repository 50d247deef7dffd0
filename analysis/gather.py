"""Gather every records file below run or sweep folders into one tidy table.

A run folder none of whose rows decoded (a run refused for a bad value, a cell that failed before its
first prompt) is left out: its failure rows would only add a failed setting, and conditions that vary
only because of it, to every label. ``gather_runs`` says which folders it left out and why.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from mars_bench.bench.baseline_cache import baseline_conditions
from mars_bench.bench.records import (
    BASELINE_CONDITIONS,
    EARLIER_BACKEND,
    MANIFEST_FILE,
    RECORDS_FILE,
    decoded_by_own_engine,
    legacy_setting_fields,
    read_rows,
)
from mars_bench.bench.summary import with_rule_statistics
from mars_bench.common.kernels import EARLIER_KERNELS
from mars_bench.common.settings import setting_string

OPTIONAL = {"temperature": 0.0, "score": None, "drafted": 0, "accepted": 0, "relaxed": 0,
            "verified_positions": 0, "draft_length": "fixed", "schema_version": 1,
            "disturbed": False, **dict.fromkeys(BASELINE_CONDITIONS), "batch_size": 1, "backend": EARLIER_BACKEND,
            "kernels": EARLIER_KERNELS}  # fmt: skip
POOLED = ["model", "task", "temperature"]  # rows that every table would put together, unless their conditions differ
PER_POSITION = ("accepted_per_depth", "reached_per_depth", "reasons", "step_accepted", "step_drafted",
                "step_draft_s", "step_target_s", "engine_step_s", "engine_step_rows")


class NoRecordsError(ValueError):
    """Nothing to analyse: the message says where we looked."""


@dataclass(frozen=True)
class LeftOut:
    """A run folder that never decoded a row: how many (failure) rows it holds and the first error."""

    folder: str
    rows: int
    error: str


@dataclass
class Gathered:
    """The records of the folders that decoded (``frame``, as ``gather`` gives it) and the folders left out."""

    frame: pd.DataFrame
    left_out: list[LeftOut] = field(default_factory=list)


def never_decoded(records: Path, rows: list[dict]) -> LeftOut | None:
    """The folder of ``records`` as left out, where none of its ``rows`` decoded; else None."""
    if any(row.get("status", "ok") == "ok" for row in rows):
        return None
    error = next((str(row["error"]) for row in rows if row.get("error")), "no error recorded")
    return LeftOut(str(records.parent), len(rows), error.splitlines()[0][:300])


def gather(folders: list[str | Path]) -> pd.DataFrame:
    """One row per record; ``run_dir`` says which folder it came from (several sweeps, machines). Folders
    that never decoded a row are left out (``gather_runs`` names them)."""
    return gather_runs(folders).frame


def gather_runs(folders: list[str | Path]) -> Gathered:
    """``gather``'s table, and the run folders it left out because none of their rows decoded."""
    frames, left_out, legacy = [], [], {}
    for folder in map(Path, folders):
        if not folder.exists():
            raise NoRecordsError(f"folder {str(folder)!r} does not exist")
        for records in sorted(folder.rglob(RECORDS_FILE)):
            rows = list(read_rows(records))
            if rows and (refused := never_decoded(records, rows)):
                left_out.append(refused)
            elif rows:
                engine = [decoded_by_own_engine(row) for row in rows]
                run = pd.DataFrame(rows).assign(run_dir=str(records.parent), own_engine=engine)
                legacy.update(dict.fromkeys(name for row in rows for name in legacy_setting_fields(row)))
                if any(row.get("schema_version", 1) < 4 for row in rows):  # written before verifier_setting
                    run["manifest_setting"] = manifest_setting(records)
                if any(row.get("schema_version", 1) < 7 for row in rows):  # written before the last conditions
                    add_manifest_conditions(run, records)
                frames.append(run)
    if not frames:
        failed = f"; folders that hold only failures: {len(left_out)} (first: {left_out[0].error})" if left_out else ""
        raise NoRecordsError(f"no {RECORDS_FILE} with finished rows below {', '.join(map(str, folders))}{failed}")
    frame = pd.concat(frames, ignore_index=True)
    for column, default in OPTIONAL.items():  # fields that older writers did not write, in some files or all
        if column not in frame:
            frame[column] = default
        elif default is not None:
            frame[column] = frame[column].fillna(default)
    for column in PER_POSITION:  # rows from failed cells, or older writers, may lack them
        frame[column] = frame[column].map(lambda v: v if isinstance(v, list) else []) if column in frame else [[]] * len(frame)
    frame["question_id"] = frame["question_id"].astype(str)  # ids are ints in some sets, strings in others
    frame = with_rule_statistics(upgrade_old_records(frame, list(legacy)))
    return Gathered(name_conditions(name_drafter_settings(frame)), left_out)


def manifest(records: Path) -> dict:
    """The manifest beside a records file (its run's first session); empty where there is none."""
    try:
        described = json.loads((records.parent / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return described if isinstance(described, dict) else {}


def add_manifest_conditions(run: pd.DataFrame, records: Path) -> None:
    """Fill the ``BASELINE_CONDITIONS`` that rows of schema 6 and older lack (attention, device map, scorer,
    threads) from the config their run's manifest gives; left unknown (None) without one."""
    try:
        known = baseline_conditions(OmegaConf.create(manifest(records).get("config") or {}))
    except (AttributeError, KeyError, ValueError):  # no manifest, or a config older than some of the keys
        return
    old = run["schema_version"].fillna(1) < 7 if "schema_version" in run else pd.Series(True, index=run.index)
    for name, value in known.items():
        if name not in run:
            run[name] = None
        lacking = old & run[name].isna()
        if value is not None and lacking.any():
            run[name] = run[name].astype(object)
            run.loc[lacking, name] = value


def manifest_setting(records: Path) -> str | None:
    """The verifier's settings as the run's manifest describes them (``key=value,...``), for
    records older than ``verifier_setting``; None without a manifest."""
    methods = manifest(records).get("methods") or {}
    described = [m["verifier"] for m in methods.values() if isinstance(m, dict) and isinstance(m.get("verifier"), dict)]
    if not described:
        return None
    return setting_string({key: value for key, value in described[0].items() if key != "name"})


def upgrade_old_records(frame: pd.DataFrame, legacy: list[str]) -> pd.DataFrame:
    """Read records of schema 6 and older as the current writer would have written them.

    ``legacy``: the fields in which those writers put the live verifier's settings beside ``verifier_setting``
    (``records.legacy_setting_fields``: the paper rule's settings, None where a verifier had none). They are
    dropped: ``verifier_setting`` holds every verifier's own. Records of schema 3 and older wrote no
    ``verifier_setting``: the run's manifest gives it (the verifier's ``describe()``), else those fields, where
    set, stand in for it. Their writers also counted the paper's trigger for every verifier; a row none of
    whose legacy fields is set ran a verifier without a trigger, so its count is dropped (a ``mars_ref`` row
    keeps the paper's guarded count, the only one it has).
    """
    old = frame["schema_version"] < 4
    described = frame.pop("manifest_setting") if "manifest_setting" in frame else pd.Series(None, index=frame.index, dtype=object)
    if old.any():
        values = frame.reindex(columns=legacy).astype(object)
        if "trigger_count" in frame:  # read as the statistic ``trigger`` (records.rule_statistics)
            frame["trigger_count"] = frame["trigger_count"].astype(object)
            frame.loc[old & values.isna().all(axis=1), "trigger_count"] = None
        fallback = [setting_string({key: value for key, value in row.items() if pd.notna(value)})
                    for row in values.to_dict("records")]  # fmt: skip
        if "verifier_setting" not in frame:
            frame["verifier_setting"] = None
        frame["verifier_setting"] = frame["verifier_setting"].astype(object)
        described = described.where(described.notna(), pd.Series(fallback, index=frame.index))
        frame.loc[old, "verifier_setting"] = described[old]
    return frame.drop(columns=[name for name in legacy if name in frame])


def name_drafter_settings(frame: pd.DataFrame) -> pd.DataFrame:
    """Where one drafter ran with several settings (gamma, tree shape), name each: ``model (gamma=3)``.

    Every table groups by the ``drafter`` column, so two shapes of one drafter stay apart; a drafter
    with one setting keeps its bare name. Records older than ``drafter_setting`` are told apart by gamma.
    """
    if "gamma" in frame:  # Int64: a column with gaps is float, and 5.0 must read as 5
        fallback = "gamma=" + pd.to_numeric(frame["gamma"]).astype("Int64").astype("string")
    else:
        fallback = pd.Series("", index=frame.index)
    setting = frame["drafter_setting"].fillna(fallback) if "drafter_setting" in frame else fallback
    setting = setting.astype("string").replace("", pd.NA)  # unknown (a failed row from an old writer): bare name
    shapes = setting.groupby(frame["drafter"]).transform("nunique")
    named = (shapes > 1) & setting.notna()
    frame.loc[named, "drafter"] = frame.loc[named, "drafter"] + " (" + setting[named] + ")"
    return frame


def shown(value: object) -> str:
    """A condition's value as a label shows it: ``None`` for none (or unrecorded), floats without a
    trailing ``.0`` (a column with gaps turns 128 into 128.0)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "None"
    return f"{value:g}" if isinstance(value, float) else str(value)


def name_conditions(frame: pd.DataFrame) -> pd.DataFrame:
    """``conditions``: each row's values of the ``BASELINE_CONDITIONS`` that differ somewhere between rows
    of one model, task and temperature, as ``max_new_tokens=128, top_p=0.9``; empty where none does (a
    sweep, usually). The tables keep settings of different conditions apart, their labels ending in them.
    A condition a record lacks (an older writer's) reads as None."""
    varying = [name for name in BASELINE_CONDITIONS if name not in POOLED
               and (frame.groupby(POOLED, dropna=False)[name].nunique(dropna=False) > 1).any()]  # fmt: skip
    frame["conditions"] = [", ".join(f"{name}={shown(value)}" for name, value in zip(varying, values))
                           for values in zip(*(frame[name] for name in varying))] if varying else ""  # fmt: skip
    return frame
