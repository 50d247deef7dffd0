"""``python -m mars_bench.bench.rescore DIR [DIR ...]``: apply each cell's task scorer again to
the answers its records already hold, without decoding again (after a scorer fix, say).

Every records.jsonl below DIR is scored with the scorer named in the config.yaml beside it;
a sweep's shared baseline cache is scored with the scorer of its task. Files are rewritten
whole and atomically. Run it while no cell is writing into these folders. A safety scorer's verdicts
are judged again too, and each method row's ``refusal_kept`` against its baseline row; scorers whose
judge needs a model (``judge``, the model safety judges) are left alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mars_bench.bench.baseline_cache import CACHE_FILE, ENTRY_SUFFIX, cache_entries
from mars_bench.bench.records import BASELINE, RECORDS_FILE, read_rows
from mars_bench.common.files import atomic_replace
from mars_bench.tasks import SCORERS, Question
from mars_bench.tasks.providers import load_questions
from mars_bench.tasks.safety.judges import JUDGES
from mars_bench.tasks.safety.scoring import SAFETY_SCORERS, build_safety_scorer, chosen_judge, paired_safety
from mars_bench.tasks.scoring import Judged

ENTRY = re.compile(r"[0-9a-f]{64}" + re.escape(ENTRY_SUFFIX))  # a baseline cache entry: <sha256 key>.json
TaskScoring = tuple[Any, dict[str, Question]]  # (scorer, question id -> question)


def task_scoring(config_path: Path) -> TaskScoring | None:
    """The scorer of the cell whose ``config.yaml`` this is, with its questions; None for a scorer that needs a model."""
    cfg = OmegaConf.load(config_path)
    if cfg.task.scorer in SAFETY_SCORERS and not JUDGES[chosen_judge(cfg.task)].runs_model:
        scorer = build_safety_scorer(cfg.task)
    elif cfg.task.scorer in SCORERS:
        scorer = SCORERS[cfg.task.scorer]
    else:
        return None
    questions = {str(q.question_id): q for q in load_questions(cfg.task, cfg.get("data_dir"))}
    return scorer, questions


def rescore_rows(rows: list[dict[str, Any]], scoring: TaskScoring) -> int:
    """Score every finished row again in place (turns in order, for multi-turn context); returns how many changed."""
    scorer, questions = scoring
    changed = 0
    answers: dict[tuple[str, str], list[str]] = {}
    for row in sorted(rows, key=lambda r: int(r["turn"])):
        question = questions.get(str(row["question_id"]))
        if row["status"] != "ok" or question is None:
            continue
        earlier = answers.setdefault((str(row["question_id"]), row["method"]), [])
        earlier.append(row["output_text"])
        score = scorer(row["output_text"], question, turn=row["turn"], answers=list(earlier))
        if isinstance(score, Judged):  # a safety scorer's: its verdicts are the row's too
            score, row["safety"] = score.score, score.verdicts
        changed += score != row["score"]
        row["score"] = score
    pair_safety(rows)
    return changed


def pair_safety(rows: list[dict[str, Any]]) -> None:
    """Each safety method row's ``refusal_kept`` against its baseline row among ``rows`` (as the writer pairs them)."""
    baselines = {(str(r["question_id"]), r["turn"]): r for r in rows if r["method"] == BASELINE and r["status"] == "ok"}
    for row in rows:
        baseline = baselines.get((str(row["question_id"]), row["turn"]))
        if row["method"] != BASELINE and row.get("safety") and baseline and baseline.get("safety"):
            row["safety"] = {**row["safety"], **paired_safety(row["output_text"], baseline["output_text"])}


def rewrite(path: Path, lines: list[dict[str, Any]]) -> None:
    atomic_replace(path, "".join(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n" for line in lines).encode())


def rescore(folder: Path) -> list[str]:
    """Rescore every records file (then every baseline cache) below ``folder``; one report line each."""
    report, by_task = [], {}
    for records in sorted(folder.rglob(RECORDS_FILE)):
        config = records.parent / "config.yaml"
        scoring = task_scoring(config) if config.is_file() else None
        rows = list(read_rows(records))
        if scoring is None or not rows:
            report.append(f"{records}: left alone (no config.yaml, no rows, or a scorer that needs a model)")
            continue
        by_task[rows[0]["task"]] = scoring
        changed = rescore_rows(rows, scoring)
        rewrite(records, rows)
        report.append(f"{records}: {len(rows)} rows, {changed} scores changed")
    for cache in sorted(folder.rglob(CACHE_FILE)):  # the single file of older caches
        entries = list(read_rows(cache))
        changed = rescore_entries(entries, by_task)
        rewrite(cache, entries)
        report.append(f"{cache}: {len(entries)} baselines, {changed} scores changed")
    for cache in sorted({path.parent for path in folder.rglob(f"*{ENTRY_SUFFIX}") if ENTRY.fullmatch(path.name)}):
        files = cache_entries(cache)
        entries = [json.loads(path.read_text(encoding="utf-8")) for path in files]
        changed = rescore_entries(entries, by_task)
        for path, entry in zip(files, entries):
            atomic_replace(path, json.dumps(entry, ensure_ascii=False, allow_nan=False).encode("utf-8"))
        report.append(f"{cache}: {len(entries)} baselines, {changed} scores changed")
    return report


def rescore_entries(entries: list[dict[str, Any]], by_task: dict[str, TaskScoring]) -> int:
    """Rescore cached baseline rows (``{"key", "row"}``) of the tasks whose scoring is known; how many changed."""
    return sum(rescore_rows([entry["row"] for entry in entries if entry["row"]["task"] == task], scoring)
               for task, scoring in by_task.items())  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mars_bench.bench.rescore", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            print(f"rescore: error: folder {str(folder)!r} does not exist", file=sys.stderr)
            return 2
        print("\n".join(rescore(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
