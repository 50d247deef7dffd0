"""``python -m analysis DIR [DIR ...] [--out FOLDER]``: gather records, write tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.gather import NoRecordsError, gather
from analysis.tables import table1, to_latex, to_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__)
    parser.add_argument("folders", nargs="+", help="run or sweep folders (searched recursively for records.jsonl)")
    parser.add_argument("--out", default="analysis_out", help="output folder (default: analysis_out)")
    args = parser.parse_args(argv)
    try:
        frame = gather(args.folders)
        table = table1(frame)
    except (NoRecordsError, ValueError) as error:
        print(f"analysis: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(out / "records.parquet")
    (out / "table1.md").write_text(to_markdown(table) + "\n")
    (out / "table1.tex").write_text(to_latex(table))
    (out / "index.md").write_text(
        "# Analysis\n\n"
        f"- [records.parquet](records.parquet): all {len(frame)} records gathered from "
        f"{frame['run_dir'].nunique()} run folders.\n"
        "- [table1.md](table1.md) / [table1.tex](table1.tex): speedup (throughput ratio over the paired baseline) and tau per "
        "model, drafter, task and verifier, with the unweighted mean over tasks (the MARS paper's Table 1 layout).\n"
    )
    print(to_markdown(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
