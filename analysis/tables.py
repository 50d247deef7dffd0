"""The MARS paper's Table 1 layout: rows = target (and drafter), column groups = tasks,
cells = speedup and tau per verifier, and a Mean column (unweighted over tasks)."""

from __future__ import annotations

import pandas as pd

from analysis.gather import finished
from mars_bench.bench.stats import throughput_ratio

BASELINE = "baseline"


def method_label(row: pd.Series) -> str:
    theta = row.get("theta")
    return (
        f"{row['verifier']} (theta {theta:g})" if row["verifier"] in ("mars", "mars_ref") and pd.notna(theta) else row["verifier"]
    )


def speed_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (model, drafter, task, method): speedup over the paired baseline rows of the same run, and tau."""
    ok = finished(frame)
    out = []
    for (_run_dir, model, drafter, task), run in ok.groupby(["run_dir", "model", "drafter", "task"]):
        base = run[run["method"] == BASELINE][["question_id", "turn", "new_tokens", "seconds"]]
        method_rows = run[run["method"] != BASELINE]
        if method_rows.empty or base.empty:
            continue
        paired = method_rows.merge(base, on=["question_id", "turn"], suffixes=("", "_base"))
        out.append(
            {
                "model": model,
                "drafter": drafter,
                "task": task,
                "method": method_label(method_rows.iloc[0]),
                "tokens": paired["new_tokens"].sum(),
                "seconds": paired["seconds"].sum(),
                "base_tokens": paired["new_tokens_base"].sum(),
                "base_seconds": paired["seconds_base"].sum(),
                "emitted": method_rows["emitted"].sum(),
                "steps": method_rows["steps"].sum(),
            }
        )
    if not out:
        raise ValueError("no run has both baseline and method rows to compare")
    cells = pd.DataFrame(out).groupby(["model", "drafter", "task", "method"], as_index=False).sum(numeric_only=True)
    cells["speedup"] = [
        throughput_ratio(r.tokens, r.seconds, r.base_tokens, r.base_seconds) for r in cells.itertuples()
    ]  # several runs of one cell pool their prompts
    cells["tau"] = cells["emitted"] / cells["steps"]
    return cells


def table1(frame: pd.DataFrame) -> pd.DataFrame:
    """Wide table: index (model, drafter, method), columns (task, speedup|tau) plus (Mean, ...)."""
    cells = speed_cells(frame)
    wide = cells.pivot_table(index=["model", "drafter", "method"], columns="task", values=["speedup", "tau"])
    wide = wide.swaplevel(0, 1, axis=1).sort_index(axis=1, level=0)
    for metric in ("speedup", "tau"):
        wide[("Mean", metric)] = cells.pivot_table(index=["model", "drafter", "method"], columns="task", values=metric).mean(
            axis=1
        )
    return wide


def to_markdown(table: pd.DataFrame) -> str:
    flat = table.copy()
    flat.columns = [f"{task} {metric}" for task, metric in flat.columns]
    flat = flat.reset_index()
    header = "| " + " | ".join(flat.columns) + " |"
    rule = "|" + "---|" * len(flat.columns)
    lines = [header, rule]
    for row in flat.itertuples(index=False):
        cells = [f"{value:.2f}x" if name.endswith("speedup") else f"{value:.2f}" if isinstance(value, float) else str(value)
                 for name, value in zip(flat.columns, row)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_latex(table: pd.DataFrame) -> str:
    """booktabs LaTeX (toprule / midrule / bottomrule), two decimals."""
    return table.style.format("{:.2f}").to_latex(hrules=True, multicol_align="c")
