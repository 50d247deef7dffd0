"""The MARS paper's Table 1 layout: rows = target (and drafter), column groups = tasks,
cells = speedup and tau per verifier (tau pooled, then its mean per request beside it: see
``bench.summary.tau_request_mean``), and a Mean column (unweighted over tasks, empty where a task
has no value: a mean over fewer tasks would not compare with the other rows')."""

from __future__ import annotations

import pandas as pd

from mars_bench.bench.summary import CUT_MARK, cut_note

from .cells import INCLUDE_CUT, method_summary, setting_name

ROWS = ["model", "drafter", "temperature", "label"]
METRICS = ("speedup", "tau", "tau_request_mean", "finished_share")  # per task, in this order


def table1(frame: pd.DataFrame, summary: pd.DataFrame | None = None) -> pd.DataFrame:
    """Wide table: index (model, drafter, temperature, method), columns (task, speedup|tau|tau_request_mean)
    plus (Mean, ...); NaN where a setting has no value (table1_notes says why)."""
    cells = method_summary(frame) if summary is None else summary
    wide = cells.pivot_table(index=ROWS, columns="task", values=list(METRICS), dropna=False)
    wide = wide.swaplevel(0, 1, axis=1)
    every = pd.MultiIndex.from_product([sorted(cells["task"].unique()), METRICS])  # a metric missing everywhere stays, empty
    wide = wide.reindex(columns=every).dropna(how="all", axis=0).rename_axis(columns=["task", None])
    for metric in METRICS:
        wide[("Mean", metric)] = wide.xs(metric, axis=1, level=1).mean(axis=1, skipna=False)
    return wide.rename_axis(index={"label": "method", "temperature": "T"})


def table1_notes(summary: pd.DataFrame, include_cut: bool = False) -> list[str]:
    """What table1.md says under the table (``summary``: method_summary's table): what ``finished_share``
    is, each setting whose answers were cut at the token budget (marked), why each setting without a
    speedup has none, and that a Mean is empty where a task is."""
    lines = ["finished_share: the share of the method's answers that ended on a stop token or string, not at "
             "max_new_tokens."]  # fmt: skip
    lines += cut_lines(summary, include_cut)
    missing = summary[summary["speedup"].isna()]
    if missing.empty:
        return lines
    lines += ["", "`-`: no value. Where a speedup is missing:", ""]
    lines += [f"- {setting_name(row)}: {row['speedup_note']}" for _, row in missing.iterrows()]
    return [*lines, "", "A Mean is empty where one of its tasks is."]


def cut_lines(summary: pd.DataFrame, include_cut: bool = False) -> list[str]:
    """One line per setting with answers cut at the token budget (``CUT_MARK``), then the footnote; none without."""
    cut = summary[summary["finished"] < summary["answers"]]
    if cut.empty:
        return []
    lines = [f"- {setting_name(row)}: {int(row['answers'] - row['finished'])} of {int(row['answers'])} answers cut{CUT_MARK}"
             for _, row in cut.iterrows()]  # fmt: skip
    return ["", *lines, "", cut_note(include_cut, INCLUDE_CUT)]


def latex_notes(lines: list[str]) -> str:
    """``lines`` under a LaTeX table, as a small paragraph (``CUT_MARK`` as LaTeX's dagger)."""
    text = " ".join(line.strip("- ") for line in lines if line.strip()).replace("`", "")
    for plain, escaped in (("\\", "\\textbackslash{}"), ("_", "\\_"), ("%", "\\%"), ("&", "\\&"), ("#", "\\#")):
        text = text.replace(plain, escaped)
    return "\\par{\\footnotesize " + text.replace(CUT_MARK, "\\textsuperscript{\\dag}") + "}\n"


def to_markdown(table: pd.DataFrame, formats: dict[str, str] | None = None) -> str:
    """A Markdown table. Flat columns (or two-level ones, joined by a space); speedups get an x."""
    flat = table.copy()
    if isinstance(flat.columns, pd.MultiIndex):
        flat.columns = [" ".join(str(part) for part in column) for column in flat.columns]
    flat = flat.reset_index() if not isinstance(flat.index, pd.RangeIndex) else flat
    formats = formats or {}

    def cell(name: str, value) -> str:
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "-"
        if name in formats:
            return formats[name].format(value)
        if isinstance(value, float):
            return f"{value:.2f}x" if name.endswith("speedup") else f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(map(str, flat.columns)) + " |", "|" + "---|" * len(flat.columns)]
    for row in flat.itertuples(index=False):
        lines.append("| " + " | ".join(cell(name, value) for name, value in zip(flat.columns, row)) + " |")
    return "\n".join(lines)


def to_latex(table: pd.DataFrame) -> str:
    """booktabs LaTeX (toprule / midrule / bottomrule): two decimals, as to_markdown shows them (the
    temperature too), ``--`` where to_markdown shows ``-`` (no value), names escaped for LaTeX."""
    styler = table.style.format("{:.2f}", na_rep="--").format_index(escape="latex", axis=1)
    for level in range(table.index.nlevels):
        floats = pd.api.types.is_float_dtype(table.index.get_level_values(level))
        styler = styler.format_index("{:.2f}" if floats else None, escape=None if floats else "latex", axis=0, level=level)
    return styler.to_latex(hrules=True, multicol_align="c")
