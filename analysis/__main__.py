"""``python -m analysis DIR [DIR ...] [--out FOLDER]``: gather the records below run or sweep
folders and write the tables, figures and an index.md that links them, and says which folders it
left out (they never decoded a row) and which it pooled into one setting."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from mars_bench.bench.records import decoded_by_own_engine
from mars_bench.bench.summary import CUT_MARK, cut_note, disturbed_note, disturbed_rows, finished, with_rule_statistics
from mars_bench.common.files import atomic_replace

from . import acceptance, batching, fidelity, figures, safety
from .cells import INCLUDE_CUT, INCLUDE_DISTURBED, NotEnoughData, method_summary, missing_speedups
from .gather import OPTIONAL, PER_POSITION, Gathered, NoRecordsError, gather_runs, name_conditions
from .quality import quality_table
from .runs import POOL_REPEATS, Pooled, pooled_settings, repeats
from .tables import latex_notes, table1, table1_notes, to_latex, to_markdown

KEYED = " The figure names settings by short keys; its key table (NAME_key.md) gives each in full."
DESCRIPTIONS = {
    "settings": "every setting (target, drafter, task, temperature, verifier and its setting, with a column for each "
    "setting that differs between a verifier's cells): prompts, run_folders (the "
    "run folders its prompts came from), disturbed (prompts whose timing other processes disturbed: left out of the "
    "speedup unless --include-disturbed), speedup with its bootstrap 95% CI (where there is none, why), tau (pooled: "
    "emitted tokens over verification steps, all requests together) and tau_request_mean (the mean of each request's "
    "tau), acceptance rate, relaxed accepts and their share, NAME_rate for each count statistic a verifier declares "
    "(the share of verified positions where it happened, e.g. trigger_rate; empty for a verifier without it), "
    "score with its CI.",
    "table1": "the MARS paper's Table 1 layout: speedup (throughput ratio over the paired AR baseline), tau (pooled) and "
    "tau_request_mean (per request, then averaged) per target, drafter, temperature and verifier, column groups per task, "
    "unweighted Mean.",
    "threshold ablation": "speedup, tau, score and the rate of each count statistic the verifiers declare against the "
    "one setting that differs between a "
    "verifier's cells (a column of panels per such verifier, the x axis named verifier: setting), one line per task; "
    "dashed: the strict verifier.",
    "pareto": "score against speedup for every verifier and setting, per task, with the Pareto front." + KEYED,
    "quality": "task score per verifier, its mean paired difference from the strict verifier (rejection when sampling, "
    "exact when greedy; the AR baseline if the strict one was not run) on the same prompts, bootstrap 95% CI of that "
    "difference, and a two-sided paired sign-flip permutation test.",
    "alpha per depth": "alpha_d, the share of drafts reaching depth d that are accepted, with its bootstrap 95% CI over "
    "prompts and the drafts reaching each depth, per verifier and task." + KEYED,
    "statistic histograms": "histograms of the value statistic {statistic}, which the verifier declares, at strict "
    "accepts, relaxed accepts and rejections, per verifier." + KEYED,
    "acceptance by statistic": "acceptance rate of verified positions per bin of the value statistic {statistic} "
    "(deciles of its values), with counts." + KEYED,
    "shadow": "acceptance rate (kept drafts / drafts) of the live verifier and of each shadow verifier on the very same "
    "drafts and target logits.",
    "fidelity": "per setting and per rule judged on its drafts (the live verifier, then each shadow): positions, expected "
    "acceptance (mean exact alpha_V per drafted position), its gain over the strict rule on the same drafts, mean "
    "KL(P_V || p) in nats and TV(P_V, p) per position of the emitted token's distribution against the target's, the "
    "bound 1 - TV(q, p) + TV(P_V, p) on the acceptance and the distance to it, gain per nat of KL, expected tau, and "
    "the score with its CI (live rows only: a shadow emits no text).",
    "frontier": "expected acceptance against mean KL and mean TV per position, and expected tau against KL, one line "
    "per rule family over its parameters, the strict rule a star, with the bounds 1 - TV(q, p) + TV and "
    "1 - TV(q, p) + sqrt(KL / 2)." + KEYED,
    "batching": "per task, rule and batch size B: the throughput speedup over the baseline at the same B (all rows' new "
    "tokens over the batches' wall time), the per-request latency speedup, tau, the peak memory, the speedup over the "
    "strict rule at the same B; with the forward costs of `python -m mars_bench.perf.batch_costs` beside the records "
    "(this package's engine) or the serving engine's own step times in them (backend=vllm; the costs column says which), "
    "the cost model's predicted speedup and measured / predicted (batching_model: the model's speedup at every timed B "
    "and the crossover, the smallest B where it falls below 1); batching_shadows: each shadow rule's tokens per step "
    "on the live rule's drafts over the live rule's; the figure draws them against B.",
    "safety": "per setting of a safety task (harmful, jailbreak, injection, over_refusal): its measure (refusal_rate, "
    "attack_success, injection_success or over_refusal) and judge, disturbed (as in settings), speedup over the AR "
    "baseline with its bootstrap 95% CI, tau, relaxed share, KL per generated token and deviation rate "
    "(fidelity=true), its rate and the lossless AR baseline's on the same prompts, the change with its paired "
    "bootstrap 95% CI and permutation p-value (prompts where both answers finished, unless --include-cut), and "
    "refusal_kept (of the baseline's refusals, those the rule's answer opens with).",
    "safety frontier": "the change in each safety task's measure against the lossless AR baseline (paired 95% CI) "
    "against the speedup, one point per rule and setting." + KEYED,
    "safety first tokens": "where the relaxed tokens fall: per setting and first-L window ({first_tokens}; "
    "--first-tokens sets them), the share of the answers' first L tokens that a lossy rule relaxed, beside its share "
    "of all their tokens; and the safety outcome of the answers with a relaxed token in their first L against those "
    "with none there: counts, the rate with its Wilson (0/1 scores) or bootstrap 95% interval, and the paired change "
    "against the baseline with its bootstrap 95% CI.",
    "safety answers": "one line per safety answer: its score and its baseline's, whether the change counts it, the "
    "answer positions of its relaxed tokens, how many fall in its first L tokens for each L, the first position where "
    "it differs from the baseline's answer and refusal_kept.",
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
        self.notes: list[str] = []  # what the index says before its entries (a speedup missing everywhere, and why)

    def make(self, what: str, build: Callable[[], list[str]], **words: str) -> None:
        """Build the artefacts ``what`` names and index them with their description (``words`` fill its blanks)."""
        try:
            names = build()
        except NotEnoughData as reason:
            self.skip(f"{what} ({', '.join(words.values())})" if words else what, reason)
            return
        links = " / ".join(f"[{name}]({name})" for name in names)
        self.lines.append(f"- {links}: {DESCRIPTIONS[what].format(**words) if words else DESCRIPTIONS[what]}")

    def skip(self, what: str, reason: NotEnoughData) -> None:
        self.skipped.append(f"- {what}: skipped, {reason}.")
        print(f"analysis: {what} skipped: {reason}", file=sys.stderr)

    def table(
        self, name: str, frame: pd.DataFrame, formats: dict[str, str] | None = None, markdown: pd.DataFrame | None = None
    ) -> list[str]:
        """``frame`` as NAME.csv and as NAME.md (``markdown`` instead where given: the same table shown)."""
        frame.to_csv(self.out / f"{name}.csv", index=False)
        (self.out / f"{name}.md").write_text(to_markdown(frame if markdown is None else markdown, formats) + "\n")
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


def read_parquet(path: Path) -> pd.DataFrame:
    """Records as ``write_parquet`` stored them, read back as ``gather`` gave them: the mapping columns
    from their JSON text, the per-position arrays as lists (the committed examples' figures are drawn so)."""
    frame = pd.read_parquet(path)
    types = pd.api.types
    for column in [name for name in frame.columns if types.is_object_dtype(frame[name]) or types.is_string_dtype(frame[name])]:
        values = frame[column].dropna()
        if len(values) and values.map(lambda value: isinstance(value, str) and value.startswith("{")).all():
            frame[column] = frame[column].map(lambda value: json.loads(value) if isinstance(value, str) else {})
        elif values.map(lambda value: hasattr(value, "tolist")).any():
            frame[column] = frame[column].map(lambda value: value.tolist() if hasattr(value, "tolist") else value)
    for column, default in OPTIONAL.items():  # fields written after the records were gathered
        if column not in frame:
            frame[column] = default
    for column in PER_POSITION:
        if column not in frame:
            frame[column] = [[] for _ in range(len(frame))]
    frame = with_rule_statistics(frame)  # tables gathered from older records carry their fields for them
    if "conditions" not in frame:
        frame = name_conditions(frame)
    if "own_engine" not in frame:
        frame["own_engine"] = [decoded_by_own_engine(row) for row in frame[["backend"]].to_dict("records")]
    return frame


def with_key(figure: Path) -> list[str]:
    """A figure that names settings by short keys, and its key table (``figures.key_path``), as index.md links them."""
    return [figure.name, figures.key_path(figure).name]


def counted(count: int, noun: str) -> str:
    """``1 run folder``, ``2 run folders``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def settings_shown(summary: pd.DataFrame) -> pd.DataFrame:
    """The settings table as settings.md shows it: a missing speedup gives its reason in its place."""
    shown = summary.drop(columns="speedup_note")
    shown["speedup"] = [note or value for note, value in zip(summary["speedup_note"], summary["speedup"].astype(object))]
    return shown


def write_all(
    frame: pd.DataFrame,
    out: Path,
    include_disturbed: bool = False,
    costs: batching.BatchCosts | None = None,
    include_cut: bool = False,
    first_tokens: tuple[int, ...] = safety.FIRST_TOKENS,
) -> Report:
    """Every artefact the records support; ``include_disturbed``: the speedups count rows whose timing
    other processes disturbed (the tables still count them in ``disturbed``); ``costs``: the forward
    costs at batch B, for the batching table's predictions; ``include_cut``: score changes count the prompts
    whose answers were cut at the token budget too (left out by default); ``first_tokens``: the first-L
    windows of the safety analysis."""
    report = Report(out)
    write_parquet(safety.without_answer_text(frame), out / "records.parquet")
    runs = frame["run_dir"].nunique()
    report.lines.append(f"- [records.parquet](records.parquet): all {counted(len(frame), 'record')}, gathered from "
                        f"{counted(runs, 'run folder')}.")  # fmt: skip
    try:
        summary = method_summary(frame, include_disturbed, include_cut)
    except NotEnoughData as reason:
        report.skipped.append(f"- every speed table and figure: skipped, {reason}.")
        summary = None
    if summary is not None:
        report.notes += [line] if (line := missing_speedups(summary)) else []
        report.make("settings", lambda: report.table("settings", summary, markdown=settings_shown(summary)))

        def write_table1() -> list[str]:
            table = table1(frame, summary)
            notes = table1_notes(summary, include_cut)
            (out / "table1.md").write_text("\n".join([to_markdown(table), "", *notes]) + "\n")
            (out / "table1.tex").write_text(to_latex(table) + latex_notes(notes))
            return ["table1.md", "table1.tex"]

        report.make("table1", write_table1)
        report.make("threshold ablation", lambda: [figures.threshold_ablation(summary, out / "threshold_ablation.png").name])
        report.make("pareto", lambda: with_key(figures.pareto(summary, out / "pareto.png")))
    report.make("quality", lambda: write_quality(frame, report, include_cut))
    write_acceptance(frame, report)
    write_fidelity(frame, report, include_disturbed)
    report.make("batching", lambda: write_batching(frame, report, costs, include_disturbed))
    write_safety(frame, report, include_disturbed, include_cut, first_tokens)
    return report


def write_quality(frame: pd.DataFrame, report: Report, include_cut: bool) -> list[str]:
    """The quality table; under it, where cut answers were left out of (or counted in) a difference, the footnote."""
    table = quality_table(frame, include_cut)
    names = report.table("quality", table, {"p_value": "{:.3f}", "prompts": "{}", "finished": "{}", "answers": "{}",
                                            "left_out": "{}", "cut": "{}"})  # fmt: skip
    if (table["left_out"] > 0).any() or (table["cut"] > 0).any():
        shown = table.assign(left_out=[f"{n}{CUT_MARK}" if n else "0" for n in table["left_out"]],
                             cut=[f"{n}{CUT_MARK}" if n else "0" for n in table["cut"]])  # fmt: skip
        markdown = to_markdown(shown, {"p_value": "{:.3f}", "prompts": "{}", "finished": "{}", "answers": "{}"})
        (report.out / "quality.md").write_text(markdown + "\n\n" + cut_note(include_cut, INCLUDE_CUT) + "\n")
    return names


def answers_line(frame: pd.DataFrame) -> str | None:
    """What index.md says about the answers' endings: how many finished, how many the budget cut (marked)."""
    ok = finished(frame)
    known = ok["finished"].dropna()
    if known.empty:
        return None
    done = sum(bool(value) for value in known)
    cut = len(known) - done
    line = f"Answers: {done} of {len(known)} ended on a stop token or string"
    return line + (f"; {cut} were cut at max_new_tokens{CUT_MARK}, and scores over them are marked." if cut else ".")


BATCHING_FORMATS = {"speedup": "{:.3f}", "latency_speedup": "{:.3f}", "predicted_speedup": "{:.3f}",
                    "predicted_latency_speedup": "{:.3f}",
                    "measured_over_predicted": "{:.3f}", "target_in_run_over_model": "{:.3f}", "tau": "{:.2f}",
                    "tau_ci_low": "{:.2f}", "tau_ci_high": "{:.2f}",
                    "gain_over_strict": "{:.3f}", "peak_memory_mb": "{:,.0f}", "peak_memory_base_mb": "{:,.0f}",
                    "modelled_step_s": "{:.1f}", "modelled_speedup": "{:.3f}", "tau_gain": "{:.3f}", "prompts": "{}",
                    "disturbed": "{}", "batch_size": "{}", "batches": "{}"}  # fmt: skip


def write_batching(frame: pd.DataFrame, report: Report, costs: batching.BatchCosts | None, include_disturbed: bool) -> list[str]:
    """The batching table, the cost model's extrapolation (with costs), the shadows' gains and the figure."""
    table = batching.batching_table(frame, costs, include_disturbed)
    names = report.table("batching", table, BATCHING_FORMATS)
    try:
        model = batching.extrapolated(frame, costs)
        names += report.table("batching_model", model, BATCHING_FORMATS)
    except NotEnoughData:  # no costs for any rows: neither batch_costs.json nor an engine's own steps
        model = None
    try:
        gains = batching.shadow_gains(frame)
        names += report.table("batching_shadows", gains, BATCHING_FORMATS)
    except NotEnoughData:
        gains = None
    return [*names, figures.batching(table, model, gains, report.out / "batching.png").name]


ALPHA_FORMATS = {"alpha": "{:.3f}", "alpha_ci_low": "{:.3f}", "alpha_ci_high": "{:.3f}"}


def write_acceptance(frame: pd.DataFrame, report: Report) -> None:
    out = report.out

    def alpha() -> list[str]:
        table = acceptance.alpha_per_depth(frame)
        figure = figures.alpha_by_depth(table, out / "alpha_per_depth.png")
        return [*report.table("alpha_per_depth", table, ALPHA_FORMATS), *with_key(figure)]

    report.make("alpha per depth", alpha)
    statistics = acceptance.value_statistics(frame)
    if not statistics:
        report.skipped.append("- statistic figures: skipped, no verifier of these rows declares a value statistic.")
    for statistic in statistics:
        write_statistic(frame, statistic, report)
    report.make("shadow", lambda: report.table("shadow", acceptance.shadow_table(frame), {"prompts": "{}", "drafted": "{}"}))


def write_statistic(frame: pd.DataFrame, statistic: str, report: Report) -> None:
    """The histograms of a value statistic by outcome and the acceptance by its bin (``acceptance.positions``)."""
    out = report.out
    try:
        positions = acceptance.positions(frame, statistic)
    except NotEnoughData as reason:
        report.skip(f"{statistic} figures", reason)
        return
    histograms = out / f"{statistic}_histograms.png"
    report.make("statistic histograms", lambda: with_key(figures.value_histograms(positions, statistic, histograms)),
                statistic=statistic)  # fmt: skip

    def by_value() -> list[str]:
        table = acceptance.acceptance_by_value(positions)
        name = f"acceptance_by_{statistic}"
        return [*report.table(name, table), *with_key(figures.acceptance_by_value_plot(table, statistic, out / f"{name}.png"))]

    report.make("acceptance by statistic", by_value, statistic=statistic)


FIDELITY_FORMATS = {"kl_per_position": "{:.3g}", "tv_per_position": "{:.3g}", "draft_tv_per_position": "{:.3f}",
                    "gain": "{:+.3f}", "gain_per_kl": "{:.3g}", "acceptance": "{:.3f}", "strict_acceptance": "{:.3f}",
                    "bound": "{:.3f}", "bound_gap": "{:.3f}", "positions": "{}", "steps": "{}", "prompts": "{}"}  # fmt: skip
DECOMPOSITION_FORMATS = {"kl_per_token": "{:.3g}", "deviation_rate": "{:.3g}", "expected_acceptance": "{:.3f}",
                         "acceptance_rate": "{:.3f}", "prompts": "{}", "tokens": "{}"}  # fmt: skip


def write_fidelity(frame: pd.DataFrame, report: Report, include_disturbed: bool = False) -> None:
    """The fidelity table, its frontier figure and the decomposition table; one skip line for all three
    when no record carries fidelity."""
    try:
        table = fidelity.fidelity_table(frame)
    except NotEnoughData as reason:
        report.skip("fidelity", reason)
        return
    out = report.out
    report.make("fidelity", lambda: report.table("fidelity", table, FIDELITY_FORMATS))
    report.make("frontier", lambda: with_key(figures.frontier(table, out / "frontier.png")))

    def decomposition() -> list[str]:
        return report.table("decomposition", fidelity.decomposition_table(frame, include_disturbed), DECOMPOSITION_FORMATS)

    report.make("decomposition", decomposition)


SAFETY_FORMATS = {"tau": "{:.2f}", "relaxed_share": "{:.3f}", "kl_per_token": "{:.3g}", "deviation_rate": "{:.3g}",
                  "rate": "{:.3f}", "baseline_rate": "{:.3f}", "change_p": "{:.3f}", "prompts": "{}",
                  "disturbed": "{}", "change_prompts": "{}", "change_cut": "{}"}  # fmt: skip
FIRST_TOKENS_FORMATS = {"relaxed_share_first": "{:.3f}", "relaxed_share_all": "{:.3f}"}


def write_safety(frame: pd.DataFrame, report: Report, include_disturbed: bool, include_cut: bool,
                 first_tokens: tuple[int, ...]) -> None:  # fmt: skip
    """The safety table, its frontier figure, the first-L table and the answers' table; one skip line for all
    four where no record carries a safety judge's verdicts."""
    try:
        pairs = safety.safety_pairs(frame, include_cut)
    except NotEnoughData as reason:
        report.skip("safety tables and figure", reason)
        return
    out = report.out
    table = safety.safety_table(pairs, include_disturbed, include_cut)

    def safety_tables() -> list[str]:
        names = report.table("safety", table, SAFETY_FORMATS, markdown=safety.shown_safety(table))
        if (table["change_cut"] > 0).any():
            with (out / "safety.md").open("a") as markdown:
                markdown.write("\n" + cut_note(include_cut, INCLUDE_CUT) + "\n")
        return names

    report.make("safety", safety_tables)
    report.make("safety frontier", lambda: with_key(figures.safety_frontier(table, out / "safety_frontier.png")))

    def first() -> list[str]:
        found = safety.first_tokens_table(pairs, first_tokens)
        return report.table("safety_first_tokens", found, FIRST_TOKENS_FORMATS, markdown=safety.shown_first_tokens(found))

    report.make("safety first tokens", first, first_tokens=", ".join(f"L = {length}" for length in first_tokens))

    def answers() -> list[str]:
        safety.answer_table(pairs, first_tokens).to_csv(out / "safety_answers.csv", index=False)
        return ["safety_answers.csv"]

    report.make("safety answers", answers)


DEFAULT_OUT = "analysis_out"


def shown_argument(folder: str) -> str:
    """A folder argument as index.md shows it: as typed where relative, else ``RUNS/<its name>``
    (``RUNS`` a placeholder for wherever it lies), so that the index names no folder of this machine."""
    return Path(folder).as_posix() if not Path(folder).is_absolute() else f"RUNS/{Path(folder).resolve().name}"


def shown_folder(folder: str | Path, arguments: list[str]) -> str:
    """A folder below one of the command's folder ``arguments``, named below that one as it is shown;
    by its own name where it lies below none."""
    path = Path(folder).resolve()
    for argument in arguments:
        root = Path(argument).resolve()
        if path == root or root in path.parents:
            return (Path(shown_argument(argument)) / path.relative_to(root)).as_posix()
    return path.name


def typed_command(argv: list[str], folders: list[str]) -> str:
    """The command as it was typed (``argv``), naming no folder of this machine: each folder argument
    as ``shown_argument`` gives it, an absolute output folder below the folder argument that holds it
    (``shown_folder``), elsewhere by its own name."""

    def out(value: str) -> str:
        return Path(value).as_posix() if not Path(value).is_absolute() else shown_folder(value, folders)

    parts, value_of_out = [], False
    for token in argv:
        if value_of_out:
            parts.append(out(token))
        elif token.startswith("--out="):
            parts.append(f"--out={out(token.removeprefix('--out='))}")
        else:
            parts.append(token if token.startswith("-") else shown_argument(token))
        value_of_out = token == "--out"
    return f"python -m {__package__ or 'analysis'} {shlex.join(parts)}"


def disturbed_line(frame: pd.DataFrame, included: bool) -> str | None:
    """What the index says about rows timed while other processes used the machine, if there were any:
    how many, how the speedups treat them, and which (``--include-disturbed`` counts them)."""
    names = disturbed_rows(frame)
    if not names:
        return None
    print(f"analysis: {len(names)} rows were timed while other processes used the machine", file=sys.stderr)
    return disturbed_note(names, included, option=INCLUDE_DISTURBED)


def folder_lines(gathered: Gathered, pooled: list[Pooled], arguments: list[str]) -> list[str]:
    """What index.md says about the run folders: those left out (none of their rows decoded) and the
    settings pooled from several (repeats of the same prompts, or disjoint prompts)."""
    lines = []
    if gathered.left_out:
        lines += [f"Left out, none of their rows decoded ({counted(len(gathered.left_out), 'run folder')}):", ""]
        lines += [f"- `{shown_folder(left.folder, arguments)}`: {counted(left.rows, 'failed row')}, first: {left.error}"
                  for left in gathered.left_out]  # fmt: skip
        lines.append("")
    if pooled:
        lines += ["Settings pooled from several run folders:", ""]
        for entry in pooled:
            folders = ", ".join(f"`{shown_folder(folder, arguments)}`" for folder in entry.folders)
            how = (f"{entry.repeated} of them measured in more than one folder, each measurement counted as a prompt "
                   f"({POOL_REPEATS})" if entry.repeated else "none measured twice (a sharded or continued run)")  # fmt: skip
            lines.append(f"- {entry.setting}: {counted(entry.prompts, 'prompt')} from {folders}; {how}")
        lines.append("")
    return lines


def repeat_error(repeated: list[Pooled], arguments: list[str], limit: int = 3) -> str:
    """The one line that refuses repeated runs of a setting, naming the first and what to do."""
    first = repeated[0]
    folders = [f"`{shown_folder(folder, arguments)}`" for folder in first.folders]
    listed = ", ".join(folders[:limit]) + (f" and {len(folders) - limit} more" if len(folders) > limit else "")
    more = f" ({counted(len(repeated) - 1, 'other setting')} likewise)" if len(repeated) > 1 else ""
    return (f"{len(folders)} run folders measured the same {counted(first.repeated, 'prompt')} of {first.setting}: "
            f"{listed}{more}; analyse one of them, or pass {POOL_REPEATS} to pool them (each measurement of a prompt "
            "then counts as a prompt)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"python -m {__package__ or 'analysis'}", description=__doc__, allow_abbrev=False)
    parser.add_argument("folders", nargs="+", help="run or sweep folders (searched recursively for records.jsonl)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument(INCLUDE_DISTURBED, action="store_true",
                        help="count rows timed while other processes used the machine in the speedups")  # fmt: skip
    parser.add_argument(INCLUDE_CUT, action="store_true",
                        help="count prompts whose answers were cut at the token budget in the score changes")  # fmt: skip
    parser.add_argument(POOL_REPEATS, action="store_true",
                        help="pool run folders that measured the same prompts of one setting (refused without it)")  # fmt: skip
    parser.add_argument(safety.FIRST_TOKENS_OPTION, default=",".join(map(str, safety.FIRST_TOKENS)), metavar="L,L,...",
                        help="the safety analysis's first-L windows: relaxed tokens and safety outcomes in each answer's "
                        "first L tokens (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        first_tokens = safety.parse_first_tokens(args.first_tokens)
    except ValueError as error:
        print(f"analysis: error: {error}", file=sys.stderr)
        return 2
    try:
        gathered = gather_runs(args.folders)
    except NoRecordsError as error:
        print(f"analysis: error: {error}", file=sys.stderr)
        return 2
    frame, pooled = gathered.frame, pooled_settings(gathered.frame)
    for left in gathered.left_out:
        print(f"analysis: left out {shown_folder(left.folder, args.folders)}: none of its rows decoded ({left.error})",
              file=sys.stderr)  # fmt: skip
    if (repeated := repeats(pooled)) and not args.pool_repeats:
        print(f"analysis: error: {repeat_error(repeated, args.folders)}", file=sys.stderr)
        return 2
    for entry in pooled:
        print(f"analysis: pooled {entry.setting} from {counted(len(entry.folders), 'run folder')}"
              + (f" ({entry.repeated} prompts measured more than once)" if entry.repeated else ""), file=sys.stderr)  # fmt: skip
    out = Path(args.out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    disturbed = disturbed_line(frame, args.include_disturbed)
    report = write_all(frame, out, args.include_disturbed, batching.find_costs(args.folders), args.include_cut, first_tokens)
    answers = answers_line(frame)
    for note in report.notes:
        print(f"analysis: {note}", file=sys.stderr)
    notes = [f"{note[0].upper()}{note[1:]}." for note in report.notes]
    index = ["# Analysis", "", f"Made by `{typed_command(argv, args.folders)}`.", "",
             *folder_lines(gathered, pooled, args.folders), *([disturbed, ""] if disturbed else []),
             *([answers, ""] if answers else []),
             *([*notes, ""] if notes else []), *report.lines]  # fmt: skip
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
