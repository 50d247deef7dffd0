"""How many answers would finish at each token budget, from records decoded at a larger one.

    python benchmarks/answer_lengths.py RUN_FOLDER [RUN_FOLDER ...] [--budgets 128 256 512 768 1024]
    python benchmarks/answer_lengths.py RUN_FOLDER [RUN_FOLDER ...] --write-lengths mars_bench/bench/measured_lengths.json

An answer that ended on a stop token or string after ``n`` new tokens ends the same way under any
budget of at least ``n`` tokens (decoding does not look at the budget before it is reached); an answer
cut at the run's own budget finishes under none of the budgets up to it. So one run at a large budget
gives, per task, the share of answers that finish at every smaller budget. Budgets above a run's own
are left out for that run's rows. This is the measurement behind the recipes' ``max_new_tokens``
(docs/tasks.md).

``--write-lengths`` writes instead the mean new tokens of every question's answers, per model option and task
(each ok row, every method, cut answers at their length): the measured lengths a main job's progress bar
predicts its duration from (``mars_bench/bench/duration.py``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

from mars_bench.bench.duration import length_key
from mars_bench.bench.records import RECORDS_FILE, read_rows
from mars_bench.bench.summary import answer_finished

DEFAULT_BUDGETS = (128, 256, 512, 768, 1024)


def answer_lengths(folders: list[Path]) -> dict[str, list[tuple[int, bool, int]]]:
    """Per task, each ok row's (new tokens, finished, the run's max_new_tokens), from every records
    file under ``folders``."""
    found = [row for folder in folders for path in sorted(folder.rglob(RECORDS_FILE)) for row in read_rows(path)]
    frame = pd.DataFrame([row for row in found if row.get("status") == "ok"])
    if frame.empty:
        return {}
    rows: dict[str, list[tuple[int, bool, int]]] = defaultdict(list)
    frame["finished"] = answer_finished(frame)  # older records say it through stop_reason
    for task, tokens, finished, budget in frame[["task", "new_tokens", "finished", "max_new_tokens"]].itertuples(index=False):
        rows[task].append((int(tokens), bool(finished), int(budget)))
    return dict(rows)


def mean_lengths(folders: list[Path]) -> dict[str, Any]:
    """The ``measured_lengths.json`` table of the ok rows under ``folders``: ``lengths[model][task][QUESTION:TURN]``,
    the mean new tokens (one decimal), with the folders and how many answers each mean rests on."""
    found: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for folder in folders:
        for path in sorted(folder.rglob(RECORDS_FILE)):
            for row in read_rows(path):
                if row.get("status") == "ok":
                    key = length_key(str(row["question_id"]), int(row["turn"]))
                    found[(row["model"], row["task"], key)].append(row["new_tokens"])
    lengths: dict[str, Any] = defaultdict(lambda: defaultdict(dict))
    answers: dict[str, Any] = defaultdict(lambda: defaultdict(dict))
    for (model, task, key), tokens in sorted(found.items()):
        lengths[model][task][key] = round(sum(tokens) / len(tokens), 1)
        answers[model][task][key] = len(tokens)
    return {"sources": [str(folder) for folder in folders], "lengths": lengths, "answers": answers}


def finished_share(rows: list[tuple[int, bool, int]], budget: int) -> tuple[int, int] | None:
    """(answers finished within ``budget`` tokens, answers), or None where a run's budget was smaller."""
    if any(run_budget < budget for _, _, run_budget in rows):
        return None
    return sum(finished and tokens <= budget for tokens, finished, _ in rows), len(rows)


def table(rows: dict[str, list[tuple[int, bool, int]]], budgets: list[int]) -> str:
    """A Markdown table: one row per task, one column per budget, each cell 'finished/answers (share)'."""
    lines = ["| task | " + " | ".join(str(budget) for budget in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for task in sorted(rows):
        cells = []
        for budget in budgets:
            share = finished_share(rows[task], budget)
            cells.append("-" if share is None else f"{share[0]}/{share[1]} ({share[0] / share[1]:.0%})")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run or sweep folders holding records.jsonl")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS), help="token budgets")
    parser.add_argument("--write-lengths", type=Path, metavar="JSON", help="write the mean length per question instead")
    args = parser.parse_args(argv)
    if args.write_lengths:
        table = mean_lengths(args.folders)
        if not table["lengths"]:
            parser.error(f"no ok rows in a {RECORDS_FILE} under {', '.join(map(str, args.folders))}")
        args.write_lengths.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        return
    rows = answer_lengths(args.folders)
    if not rows:
        parser.error(f"no ok rows in a {RECORDS_FILE} under {', '.join(map(str, args.folders))}")
    print(table(rows, args.budgets))


if __name__ == "__main__":
    main()
