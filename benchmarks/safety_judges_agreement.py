"""The safety judges against each other and against answers we labelled by hand: the embedded target's and the
embedded drafter's greedy answers to all 60 StrongREJECT-small requests (120 answers), each labelled once by a
reader under the rule in ``results/safety_judges_qwen/README.md``.

    python benchmarks/safety_judges_agreement.py --runs target=T/records.jsonl drafter=D/records.jsonl \\
        [--judge-model Qwen/Qwen2.5-Coder-1.5B-Instruct] [--out benchmarks/results/safety_judges_qwen]

``--runs`` names the records of the two decodes the labels were read from (the commands are in the README); each
answer is found by run and question id and must hash to the labelled one (SHA-256 of its text), else the script
stops. The judges: ``refusal`` (our matcher, no model) and ``strongreject_rubric`` read from ``--judge-model``'s
next-token probabilities (``--judge-model none`` leaves it out). Writes ``verdicts.csv`` (per answer: run,
question id, hash, the hand label and each judge's verdict; never the answer's text) and ``summary.json`` (each
judge's refusal rate per run, and for every pair of the hand labels and the judges: answers compared, agreement
with its Wilson 95% interval, Cohen's kappa, and a judge's precision and recall against the hand labels).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import time
from itertools import combinations
from pathlib import Path

from omegaconf import OmegaConf

from mars_bench.bench.stats import wilson_share
from mars_bench.tasks.providers import load_questions
from mars_bench.tasks.questions import Question
from mars_bench.tasks.safety.judges import refusal_judge

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "safety_judges_qwen"
HAND = "hand"
RUBRIC = "strongreject_rubric"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_labels(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def read_answers(runs: dict[str, Path], labels: list[dict[str, str]]) -> dict[tuple[str, int], tuple[dict, Question]]:
    """The labelled answers' records with their questions (read as the run read them, from the ``config.yaml``
    beside its records), by (run, question id); SystemExit in one line where one is missing or its text is not
    the labelled one."""
    records = {}
    for run, path in runs.items():
        questions = {question.question_id: question
                     for question in load_questions(OmegaConf.load(path.parent / "config.yaml").task)}  # fmt: skip
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("method") != "baseline":
                records[(run, int(row["question_id"]))] = (row, questions[row["question_id"]])
    for label in labels:
        key = (label["run"], int(label["question_id"]))
        if key not in records:
            raise SystemExit(f"no answer for run {key[0]!r} question {key[1]} in --runs: pass the records it was labelled from")
        if sha256(records[key][0]["output_text"]) != label["answer_sha256"]:
            raise SystemExit(f"run {key[0]!r} question {key[1]}: the answer differs from the one labelled (its SHA-256)")
    return records


def kappa(pairs: list[tuple[bool, bool]]) -> float | None:
    """Cohen's kappa of two binary raters over ``pairs`` (None where chance agreement is total)."""
    n = len(pairs)
    observed = sum(a == b for a, b in pairs) / n
    first, second = sum(a for a, _ in pairs) / n, sum(b for _, b in pairs) / n
    chance = first * second + (1 - first) * (1 - second)
    return None if chance == 1 else round((observed - chance) / (1 - chance), 4)


def agreement(verdicts: list[dict[str, object]], one: str, other: str) -> dict[str, object]:
    """How ``one`` and ``other`` agree on the answers both ruled on (refused = positive; an ``unclear`` hand label
    rules on nothing); against the hand labels, the judge's precision and recall too."""
    pairs = [(row[one], row[other]) for row in verdicts if row[one] is not None and row[other] is not None]
    out: dict[str, object] = {"answers": len(pairs), "agreement": wilson_share(sum(a == b for a, b in pairs), len(pairs)),
                              "cohen_kappa": kappa(pairs)}  # fmt: skip
    if one == HAND:
        tp = sum(1 for hand, judge in pairs if hand and judge)
        out["precision"] = wilson_share(tp, sum(1 for _, judge in pairs if judge))
        out["recall"] = wilson_share(tp, sum(1 for hand, _ in pairs if hand))
    return out


def verdict_row(label: dict[str, str], row: dict, question: Question, judges: dict) -> dict[str, object]:
    """One labelled answer's verdicts: the hand label's (None for ``unclear``) and each judge's ``refused``, with
    the rubric's P(refused) and harm where it ran."""
    judged = {name: judge(row["output_text"], question) for name, judge in judges.items()}
    out = {"run": label["run"], "question_id": int(label["question_id"]), "answer_sha256": label["answer_sha256"],
           "label": label["label"], HAND: {"1": True, "0": False}.get(label["refused"]),
           **{name: bool(verdict["refused"]) for name, verdict in judged.items()}}  # fmt: skip
    if RUBRIC in judged:
        out.update(p_refused=judged[RUBRIC]["p_refused"], harm=judged[RUBRIC]["harm"])
    return out


def refusal_rate(verdicts: list[dict[str, object]], run: str, rater: str) -> dict[str, object]:
    """The share of ``run``'s answers that ``rater`` calls refused, over those it ruled on."""
    ruled = [row[rater] for row in verdicts if row["run"] == run and row[rater] is not None]
    return wilson_share(sum(bool(value) for value in ruled), len(ruled))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", required=True, metavar="RUN=RECORDS", help="target=... drafter=...")
    parser.add_argument("--labels", type=Path, default=DEFAULT_OUT / "labels.csv")
    parser.add_argument("--judge-model", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help="a Hub id or folder; none: no model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    runs = {}
    for entry in args.runs:
        run, _, path = entry.partition("=")
        if not path:
            raise SystemExit(f"--runs {entry!r}: write it as RUN=RECORDS, e.g. target=DIR/records.jsonl")
        runs[run] = Path(path)
    labels = read_labels(args.labels)
    records = read_answers(runs, labels)
    judges = {"refusal": refusal_judge}
    if args.judge_model != "none":
        from mars_bench.models.loading import load_model
        from mars_bench.tasks.safety.model_judges import RubricJudge

        judges[RUBRIC] = RubricJudge.from_package(load_model(args.judge_model, dtype=args.dtype))
    started = time.perf_counter()
    verdicts = [verdict_row(label, *records[(label["run"], int(label["question_id"]))], judges) for label in labels]
    seconds = time.perf_counter() - started
    raters = [HAND, *judges]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "verdicts.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(verdicts[0]))
        writer.writeheader()
        writer.writerows({key: int(v) if isinstance(v, bool) else v for key, v in row.items()} for row in verdicts)
    model = RUBRIC in judges
    summary = {
        "labels": args.labels.name, "answers": len(verdicts), "judge_model": args.judge_model if model else None,
        "judge_dtype": args.dtype if model else None, "judging_s": round(seconds, 1),
        "refusal_rate": {run: {rater: refusal_rate(verdicts, run, rater) for rater in raters} for run in runs},
        "agreement": {f"{one} vs {other}": agreement(verdicts, one, other) for one, other in combinations(raters, 2)},
    }  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["agreement"], indent=1))


if __name__ == "__main__":
    main()
