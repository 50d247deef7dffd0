"""The end-of-run summary: per method tok/s, speedup vs the baseline (throughput ratio with
a paired bootstrap 95% CI, and the paper's mean-of-rates convention), tau and score."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from mars_bench.bench.stats import bootstrap_ratio_ci, mean_rate_ratio, throughput_ratio

BASELINE = "baseline"


def summarise(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per (cell, method). Prompts pair on (question_id, turn)."""
    frame = pd.DataFrame([row for row in rows if row.get("status", "ok") == "ok"])
    if frame.empty:
        return pd.DataFrame()
    frame["seconds"] = frame["prefill_s"] + frame["decode_s"]
    frame["emitted"] = frame["new_tokens"] - 1
    out = []
    for cell, cell_rows in frame.groupby("cell", sort=False):
        base = cell_rows[cell_rows["method"] == BASELINE][["question_id", "turn", "new_tokens", "seconds"]]
        for method, group in cell_rows.groupby("method", sort=False):
            paired = group.merge(base, on=["question_id", "turn"], suffixes=("", "_base"), how="inner")
            args = (paired["new_tokens"], paired["seconds"], paired["new_tokens_base"], paired["seconds_base"])
            low, high = bootstrap_ratio_ci(*args) if len(paired) else (float("nan"), float("nan"))
            steps = group["steps"].sum()
            verified = group["verified_positions"].sum()
            out.append(
                {
                    "cell": cell,
                    "method": method,
                    "verifier": group["verifier"].iloc[0] if method != BASELINE else BASELINE,
                    "theta": group["theta"].iloc[0] if method != BASELINE else None,
                    "prompts": len(group),
                    "tokens": int(group["new_tokens"].sum()),
                    "tok_per_s": group["new_tokens"].sum() / group["seconds"].sum(),
                    "speedup": throughput_ratio(*args) if len(paired) else float("nan"),
                    "speedup_ci_low": low,
                    "speedup_ci_high": high,
                    "speedup_mean_rate": mean_rate_ratio(*args) if len(paired) else float("nan"),
                    "tau": group["emitted"].sum() / steps if steps else float("nan"),
                    "relaxed": int(group["relaxed"].sum()),
                    "trigger_rate": group["trigger_count"].sum() / verified if verified and method != BASELINE else None,
                    "agreement": group["agreement"].mean() if method != BASELINE else 1.0,
                    "score": group["score"].mean() if group["score"].notna().any() else None,
                }
            )
    return pd.DataFrame(out)


def format_table(summary: pd.DataFrame) -> str:
    """A Markdown table for the terminal."""
    if summary.empty:
        return "no finished rows to summarise"
    lines = [
        "| cell | method | prompts | tok/s | speedup [95% CI] | speedup (mean of rates) "
        "| tau | trigger rate | agreement | score |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: Any, pattern: str = "{:.2f}") -> str:
        return "-" if value is None or pd.isna(value) else pattern.format(value)

    for row in summary.to_dict("records"):
        ci = f"{fmt(row['speedup'])}x [{fmt(row['speedup_ci_low'])}, {fmt(row['speedup_ci_high'])}]"
        lines.append(
            f"| {row['cell']} | {row['method']} | {row['prompts']} | {fmt(row['tok_per_s'])} | {ci} | "
            f"{fmt(row['speedup_mean_rate'])}x | {fmt(row['tau'])} | {fmt(row['trigger_rate'], '{:.3f}')} | "
            f"{fmt(row['agreement'], '{:.3f}')} | {fmt(row['score'], '{:.3f}')} |"
        )
    return "\n".join(lines)


def write_summary(rows: list[dict[str, Any]], folder: Path) -> str:
    summary = summarise(rows)
    summary.to_csv(folder / "summary.csv", index=False)
    return format_table(summary)
