"""``python -m mars_bench.bench.rescore DIR [DIR ...]``: apply each cell's task scorer again to
the answers its records already hold, without decoding again (after a scorer fix, say).

Every records.jsonl below DIR is scored with the scorer named in the config.yaml beside it;
a sweep's shared baseline cache is scored with the scorer of its task. Files are rewritten
whole and atomically. Run it while no cell is writing into these folders. Judge scorers need
a model and are left alone.
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
from mars_bench.bench.records import RECORDS_FILE, read_rows
from mars_bench.common.files import atomic_replace
from mars_bench.tasks import SCORERS, Question
from mars_bench.tasks.providers import load_questions

ENTRY = re.compile(r"[0-9a-f]{64}" + re.escape(ENTRY_SUFFIX))  # a baseline cache entry: <sha256 key>.json
TaskScoring = tuple[Any, dict[str, Question]]  # (scorer, question id -> question)


def task_scoring(config_path: Path) -> TaskScoring | None:
    cfg = OmegaConf.load(config_path)
    if cfg.task.scorer not in SCORERS:
        return None
    questions = {str(q.question_id): q for q in load_questions(cfg.task, cfg.get("data_dir"))}
    return SCORERS[cfg.task.scorer], questions


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
        changed += score != row["score"]
        row["score"] = score
    return changed


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
