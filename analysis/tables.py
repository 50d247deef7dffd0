"""The MARS paper's Table 1 layout: rows = target (and drafter), column groups = tasks,
cells = speedup and tau per verifier (tau pooled, then its mean per request beside it: see
``bench.summary.tau_request_mean``), and a Mean column (unweighted over tasks)."""

from __future__ import annotations

import pandas as pd

from .cells import method_summary

ROWS = ["model", "drafter", "temperature", "label"]
METRICS = ("speedup", "tau", "tau_request_mean")  # per task, in this order


def table1(frame: pd.DataFrame, summary: pd.DataFrame | None = None) -> pd.DataFrame:
    """Wide table: index (model, drafter, temperature, method), columns (task, speedup|tau|tau_request_mean)
    plus (Mean, ...)."""
    cells = method_summary(frame) if summary is None else summary
    wide = cells.pivot_table(index=ROWS, columns="task", values=list(METRICS))
    wide = wide.swaplevel(0, 1, axis=1)
    wide = wide[sorted(wide.columns, key=lambda column: (column[0], METRICS.index(column[1])))]
    for metric in METRICS:
        wide[("Mean", metric)] = cells.pivot_table(index=ROWS, columns="task", values=metric).mean(axis=1)
    return wide.rename_axis(index={"label": "method", "temperature": "T"})


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
    """booktabs LaTeX (toprule / midrule / bottomrule), two decimals."""
    return table.style.format("{:.2f}").to_latex(hrules=True, multicol_align="c")
