"""``python -m analysis DIR [DIR ...] [--out FOLDER]``: gather the records below run or sweep
folders and write the tables, figures and an index.md that links them."""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from mars_bench.bench.summary import disturbed_note, disturbed_rows
from mars_bench.files import atomic_replace

from . import acceptance, fidelity, figures
from .cells import NotEnoughData, method_summary
from .gather import NoRecordsError, gather
from .quality import quality_table
from .tables import table1, to_latex, to_markdown

DESCRIPTIONS = {
    "settings": "every setting (target, drafter, task, temperature, verifier and its setting): prompts, speedup with its "
    "bootstrap 95% CI, tau (pooled: emitted tokens over verification steps, all requests together) and tau_request_mean "
    "(the mean of each request's tau), acceptance rate, the verifier's own trigger rate (empty for a verifier without a "
    "trigger), margin_over_0.9 (a counterfactual from the recorded margins, for every verifier: the share of verified "
    "positions where the paper's rule at theta 0.9 would relax), score with its CI.",
    "table1": "the MARS paper's Table 1 layout: speedup (throughput ratio over the paired AR baseline), tau (pooled) and "
    "tau_request_mean (per request, then averaged) per target, drafter, temperature and verifier, column groups per task, "
    "unweighted Mean.",
    "threshold ablation": "speedup, tau, score and trigger rate against theta on one x axis, one line per task; dashed: "
    "the strict verifier.",
    "pareto": "score against speedup for every verifier and theta, per task, with the Pareto front.",
    "quality": "task score per verifier, its mean paired difference from the strict verifier (rejection when sampling, "
    "exact when greedy; the AR baseline if the strict one was not run) on the same prompts, bootstrap 95% CI of that "
    "difference, and a two-sided paired sign-flip permutation test.",
    "alpha per depth": "alpha_d, the share of drafts reaching depth d that are accepted, per verifier and task.",
    "margin histograms": "histograms of the margin z2 / z1 at strict accepts, relaxed accepts and rejections, per verifier.",
    "acceptance by margin": "acceptance rate of verified positions per margin bin, with counts.",
    "shadow": "acceptance rate (kept drafts / drafts) of the live verifier and of each shadow verifier on the very same "
    "drafts and target logits.",
    "fidelity": "per setting and per rule judged on its drafts (the live verifier, then each shadow): positions, expected "
    "acceptance (mean exact alpha_V per drafted position), its gain over the strict rule on the same drafts, mean "
    "KL(P_V || p) in nats and TV(P_V, p) per position of the emitted token's distribution against the target's, the "
    "bound 1 - TV(q, p) + TV(P_V, p) on the acceptance and the distance to it, gain per nat of KL, expected tau, and "
    "the score with its CI (live rows only: a shadow emits no text).",
    "frontier": "expected acceptance against mean KL and mean TV per position, and expected tau against KL, one line "
    "per rule family over its parameters, the strict rule a star, with the bounds 1 - TV(q, p) + TV and "
    "1 - TV(q, p) + sqrt(KL / 2).",
    "decomposition": "per cell in sweep order (then pooled over tasks): tau (pooled, and its mean per request), speedup "
    "with its CI, the live verifier's sequence-level KL to the target per generated token (nats), its deviation rate (TV "
    "per generated token) and the score with its CI: where a sweep's gain comes from, step by step.",
}


class Report:
    """Writes artefacts into one folder and keeps the index lines (or why one was skipped)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.skipped: list[str] = []

    def make(self, what: str, build: Callable[[], list[str]]) -> None:
        try:
            names = build()
        except NotEnoughData as reason:
            self.skip(what, reason)
            return
        links = " / ".join(f"[{name}]({name})" for name in names)
        self.lines.append(f"- {links}: {DESCRIPTIONS[what]}")

    def skip(self, what: str, reason: NotEnoughData) -> None:
        self.skipped.append(f"- {what}: skipped, {reason}.")
        print(f"analysis: {what} skipped: {reason}", file=sys.stderr)

    def table(self, name: str, frame: pd.DataFrame, formats: dict[str, str] | None = None) -> list[str]:
        frame.to_csv(self.out / f"{name}.csv", index=False)
        (self.out / f"{name}.md").write_text(to_markdown(frame, formats) + "\n")
        return [f"{name}.md", f"{name}.csv"]


def write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """The records as Parquet, written whole or not at all. Mapping columns (``shadow_accepted``:
    shadow -> drafts kept per step) are stored as JSON text: their keys differ between runs, and a
    run without shadows has only empty mappings, which Parquet cannot store as a struct."""
    table = frame.copy()
    for column in [name for name in table.columns if pd.api.types.is_object_dtype(table[name])]:
        if table[column].map(lambda value: isinstance(value, dict)).any():
            table[column] = table[column].map(lambda value: json.dumps(value) if isinstance(value, dict) else None)
    buffer = io.BytesIO()
    table.to_parquet(buffer)
    atomic_replace(path, buffer.getvalue())


def write_all(frame: pd.DataFrame, out: Path, include_disturbed: bool = False) -> Report:
    """Every artefact the records support; ``include_disturbed``: the speedups count rows whose timing
    other processes disturbed (the records keep their flag)."""
    report = Report(out)
    write_parquet(frame, out / "records.parquet")
    runs = frame["run_dir"].nunique()
    report.lines.append(f"- [records.parquet](records.parquet): all {len(frame)} records, gathered from {runs} run folders.")
    if include_disturbed:
        frame = frame.assign(disturbed=False)
    try:
        summary = method_summary(frame)
    except NotEnoughData as reason:
        report.skipped.append(f"- every speed table and figure: skipped, {reason}.")
        summary = None
    if summary is not None:
        report.make("settings", lambda: report.table("settings", summary))

        def write_table1() -> list[str]:
            table = table1(frame, summary)
            (out / "table1.md").write_text(to_markdown(table) + "\n")
            (out / "table1.tex").write_text(to_latex(table))
            return ["table1.md", "table1.tex"]

        report.make("table1", write_table1)
        report.make("threshold ablation", lambda: [figures.threshold_ablation(summary, out / "threshold_ablation.png").name])
        report.make("pareto", lambda: [figures.pareto(summary, out / "pareto.png").name])
    report.make("quality", lambda: report.table("quality", quality_table(frame), {"p_value": "{:.3f}", "prompts": "{}"}))
    write_acceptance(frame, report)
    write_fidelity(frame, report)
    return report


def write_acceptance(frame: pd.DataFrame, report: Report) -> None:
    out = report.out

    def alpha() -> list[str]:
        table = acceptance.alpha_per_depth(frame)
        figure = figures.alpha_by_depth(table, out / "alpha_per_depth.png")
        return [*report.table("alpha_per_depth", table), figure.name]

    report.make("alpha per depth", alpha)
    try:
        positions = acceptance.positions(frame)
    except NotEnoughData as reason:
        report.skipped.append(f"- margin figures: skipped, {reason}.")
        positions = None
    if positions is not None:
        report.make("margin histograms", lambda: [figures.margin_histograms(positions, out / "margin_histograms.png").name])

        def by_margin() -> list[str]:
            table = acceptance.acceptance_by_margin(positions)
            return [*report.table("acceptance_by_margin", table),
                    figures.acceptance_by_margin_plot(table, out / "acceptance_by_margin.png").name]  # fmt: skip

        report.make("acceptance by margin", by_margin)
    report.make("shadow", lambda: report.table("shadow", acceptance.shadow_table(frame), {"prompts": "{}", "drafted": "{}"}))


FIDELITY_FORMATS = {"kl_per_position": "{:.3g}", "tv_per_position": "{:.3g}", "draft_tv_per_position": "{:.3f}",
                    "gain": "{:+.3f}", "gain_per_kl": "{:.3g}", "acceptance": "{:.3f}", "strict_acceptance": "{:.3f}",
                    "bound": "{:.3f}", "bound_gap": "{:.3f}", "positions": "{}", "steps": "{}", "prompts": "{}"}  # fmt: skip
DECOMPOSITION_FORMATS = {"kl_per_token": "{:.3g}", "deviation_rate": "{:.3g}", "expected_acceptance": "{:.3f}",
                         "acceptance_rate": "{:.3f}", "prompts": "{}", "tokens": "{}"}  # fmt: skip


def write_fidelity(frame: pd.DataFrame, report: Report) -> None:
    """The fidelity table, its frontier figure and the decomposition table; one skip line for all three
    when no record carries fidelity."""
    try:
        table = fidelity.fidelity_table(frame)
    except NotEnoughData as reason:
        report.skip("fidelity", reason)
        return
    out = report.out
    report.make("fidelity", lambda: report.table("fidelity", table, FIDELITY_FORMATS))
    report.make("frontier", lambda: [figures.frontier(table, out / "frontier.png").name])

    def decomposition() -> list[str]:
        return report.table("decomposition", fidelity.decomposition_table(frame), DECOMPOSITION_FORMATS)

    report.make("decomposition", decomposition)


def portable_command(folders: list[str], out: Path) -> str:
    """The command that made the output, naming no folder of this machine: each run folder by its
    own name below a placeholder ``RUNS``, the output folder likewise where it lies inside one."""
    runs = [Path(folder).resolve() for folder in folders]
    named = [f"RUNS/{run.name}" for run in runs]
    target = out.resolve()
    inside = next((run for run in runs if run == target or run in target.parents), None)
    out_name = (Path("RUNS", inside.name) / target.relative_to(inside)).as_posix() if inside else target.name
    return f"python -m {__package__ or 'analysis'} {' '.join(named)} --out {out_name}"


def disturbed_line(frame: pd.DataFrame, included: bool) -> str | None:
    """What the index says about rows timed while other processes used the machine, if there were any:
    how many, how the speedups treat them, and which (``--include-disturbed`` counts them)."""
    names = disturbed_rows(frame)
    if not names:
        return None
    print(f"analysis: {len(names)} rows were timed while other processes used the machine", file=sys.stderr)
    return disturbed_note(names, included, option="--include-disturbed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__ or 'analysis'}", description=__doc__)
    parser.add_argument("folders", nargs="+", help="run or sweep folders (searched recursively for records.jsonl)")
    parser.add_argument("--out", default="analysis_out", help="output folder (default: analysis_out)")
    parser.add_argument("--include-disturbed", action="store_true",
                        help="count rows timed while other processes used the machine in the speedups")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        frame = gather(args.folders)
    except NoRecordsError as error:
        print(f"analysis: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    disturbed = disturbed_line(frame, args.include_disturbed)
    report = write_all(frame, out, args.include_disturbed)
    command = portable_command(args.folders, out) + (" --include-disturbed" if args.include_disturbed else "")
    index = ["# Analysis", "", f"Made by `{command}`.", "", *([disturbed, ""] if disturbed else []), *report.lines]
    if report.skipped:
        index += ["", "Not made from these records:", "", *report.skipped]
    (out / "index.md").write_text("\n".join(index) + "\n")
    print(f"analysis: wrote {len(report.lines)} entries to {out / 'index.md'}"
          + (f" ({len(report.skipped)} skipped)" if report.skipped else ""))  # fmt: skip
    return 0


def cli() -> None:
    """The ``mars-bench-analysis`` command of an installed wheel (``python -m mars_bench.analysis`` there)."""
    raise SystemExit(main())


if __name__ == "__main__":
    cli()
