"""Our refusal matcher against the answers people labelled in PyRIT's refusal-scorer set (169 answers, 109 refused).

    python benchmarks/refusal_matcher_pyrit.py [--out benchmarks/results/refusal_matcher_pyrit]

Writes ``verdicts.csv`` (per answer: file, row, the answer's SHA-256, the person's label, ours and the kind of
phrase we found; never the answer's text) and ``summary.json`` (precision and recall with Wilson 95% intervals,
overall and per file, and how many labelled refusals say "can't/cannot/unable ... help/assist", with how many of
those ours catches). The set is read from the pinned pyrit wheel (``tasks/safety/labels.py``); no model runs.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
from pathlib import Path

from mars_bench.bench.stats import wilson_share
from mars_bench.tasks.safety.labels import REFUSAL_FILES, LabelledAnswer, refusal_labels
from mars_bench.tasks.safety.refusal import OPENING_CHARS, find_refusal, normalise
from mars_bench.tasks.safety.sets import PYRIT

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "refusal_matcher_pyrit"
# the phrasing the published prefix lists are known to miss: a first-person "can't help"-style refusal
CANT_HELP = re.compile(r"\b(?:can't|cannot|can not|won't|unable to|not able to) (?:\w+ )?(?:help|assist)\b")


def confusion(rows: list[tuple[LabelledAnswer, bool]]) -> dict[str, object]:
    """Precision and recall of our verdicts (refused = positive) against the labels, with the counts."""
    tp = sum(1 for answer, ours in rows if ours and answer.refused)
    fp = sum(1 for answer, ours in rows if ours and not answer.refused)
    fn = sum(1 for answer, ours in rows if not ours and answer.refused)
    tn = len(rows) - tp - fp - fn
    return {"answers": len(rows), "labelled_refused": tp + fn, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "precision": wilson_share(tp, tp + fp), "recall": wilson_share(tp, tp + fn),
            "compliant_called_refused": wilson_share(fp, fp + tn)}  # fmt: skip


def measure(out: Path) -> dict[str, object]:
    """Judge every labelled answer, write ``verdicts.csv`` and ``summary.json`` into ``out``, return the summary."""
    answers = refusal_labels()
    matches = [find_refusal(answer.answer) for answer in answers]
    rows = [(answer, match is not None) for answer, match in zip(answers, matches)]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "verdicts.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "row", "answer_sha256", "human_refused", "ours_refused", "ours_kind"])
        for answer, match in zip(answers, matches):
            digest = hashlib.sha256(answer.answer.encode("utf-8")).hexdigest()
            writer.writerow([answer.file, answer.row, digest, int(answer.refused), int(match is not None),
                             match.kind if match else ""])  # fmt: skip
    styled = [(answer, ours) for answer, ours in rows if answer.refused and CANT_HELP.search(normalise(answer.answer))]
    package, version = PYRIT.split("==")
    summary = {
        "command": "python benchmarks/refusal_matcher_pyrit.py",
        "labels": {"package": package, "version": version, "files": REFUSAL_FILES},
        "matcher": {"module": "mars_bench/tasks/safety/refusal.py", "opening_chars": OPENING_CHARS},
        "all": confusion(rows),
        "per_file": {name: confusion([row for row in rows if row[0].file == name]) for name in REFUSAL_FILES},
        "cant_help_refusals_caught": wilson_share(sum(ours for _, ours in styled), len(styled)),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the results folder (default: %(default)s)")
    summary = measure(parser.parse_args(argv).out)
    overall = summary["all"]
    print(f"precision {overall['precision']['share']} {overall['precision']['wilson95']}, "
          f"recall {overall['recall']['share']} {overall['recall']['wilson95']} over {overall['answers']} answers")  # fmt: skip


if __name__ == "__main__":
    main()
