"""How many answers would finish at each token budget, from records decoded at a larger one.

    python benchmarks/answer_lengths.py RUN_FOLDER [RUN_FOLDER ...] [--budgets 128 256 512 768 1024]

An answer that ended on a stop token or string after ``n`` new tokens ends the same way under any
budget of at least ``n`` tokens (decoding does not look at the budget before it is reached); an answer
cut at the run's own budget finishes under none of the budgets up to it. So one run at a large budget
gives, per task, the share of answers that finish at every smaller budget. Budgets above a run's own
are left out for that run's rows. This is the measurement behind the recipes' ``max_new_tokens``
(docs/tasks.md).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import pandas as pd

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
    args = parser.parse_args(argv)
    rows = answer_lengths(args.folders)
    if not rows:
        parser.error(f"no ok rows in a {RECORDS_FILE} under {', '.join(map(str, args.folders))}")
    print(table(rows, args.budgets))


if __name__ == "__main__":
    main()
