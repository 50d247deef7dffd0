"""Figures (PNG, matplotlib's Agg backend): the threshold ablation (any verifier's swept setting), the speed-quality Pareto
front, alpha per depth, margin histograms by outcome, acceptance by margin bin and the fidelity
frontier (expected acceptance against KL and TV to the target).

Every figure takes the tidy tables of cells.py / acceptance.py / fidelity.py, never raw records.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from mars_bench.bench.summary import CUT_MARK  # noqa: E402
from mars_bench.common.strict_rule import strict_verifier  # noqa: E402

from .cells import NotEnoughData, Sweep, missing_speedups, setting_sweeps  # noqa: E402

DPI = 130
DRAFTERS = {"model": "separate draft model", "model_tree": "separate draft model, top-k tree", "layerskip": "layer-skip",
            "lookup": "prompt lookup", "eagle3": "EAGLE-3 head", "none": "no drafter"}  # fmt: skip


def _save(figure, path: Path) -> Path:
    figure.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(figure)
    return path


def _drafter_title(name: str) -> str:
    """The readable drafter name, its setting kept: ``model (gamma=3)`` -> ``separate draft model (gamma=3)``."""
    base, bracket, setting = name.partition(" (")
    return DRAFTERS.get(base, base) + bracket + setting


def _title(summary: pd.DataFrame) -> str:
    drafters = [_drafter_title(name) for name in sorted(map(str, summary["drafter"].unique()))]
    parts = [f"target {', '.join(sorted(map(str, summary['model'].unique())))}",
             f"drafter: {', '.join(drafters)}",
             f"T = {', '.join(f'{t:g}' for t in sorted(summary['temperature'].unique()))}"]  # fmt: skip
    return " | ".join(parts)


def _log_counts(axis) -> None:
    """Make ``axis``'s y axis a log axis of counts labelled in plain numbers, never ``2×10⁰``: every integer
    where it spans a decade or less, 1, 2, 5, 10, 20, ... up to three decades, else 1, 10, 100, ...;
    call it after drawing."""
    axis.set_yscale("log")
    low, high = axis.get_ylim()
    decades = np.log10(max(high, 1.0) / max(low, 0.5))
    subs = tuple(range(1, 10)) if decades <= 1 else ((1.0, 2.0, 5.0) if decades <= 3 else (1.0,))
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:,.0f}" if value >= 1 else f"{value:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())


def _no_data(axis, reason: str) -> None:
    """Write ``reason`` across an empty panel."""
    axis.text(0.5, 0.5, textwrap.fill(reason, 70), ha="center", va="center", fontsize=8, transform=axis.transAxes,
              bbox={"facecolor": "white", "edgecolor": "grey", "boxstyle": "round"}, zorder=5)  # fmt: skip


def _error_bars(values: pd.Series, low: pd.Series, high: pd.Series) -> np.ndarray | None:
    if low.isna().all():
        return None
    return np.vstack([(values - low).clip(lower=0).fillna(0), (high - values).clip(lower=0).fillna(0)])


ABLATION_PANELS = [  # (metric, y label, with its CI)
    ("speedup", "speedup over AR baseline (x)", True),
    ("tau", "tau (tokens per target forward)", False),
    ("score", "task score (mean per prompt)", True),
    ("trigger_rate", "trigger rate (share of verified positions)", False),
]
SWEPT = "_swept"  # the column holding a row's value of the swept setting, in the figures' own tables


def threshold_ablation(summary: pd.DataFrame, path: Path) -> Path:
    """Speedup, tau, score and trigger rate against a verifier's swept setting (``cells.setting_sweeps``: the one
    setting that differs between its cells, a number), a column of panels per such verifier sharing its x axis
    (named ``verifier: setting``), one line per task (and baseline conditions); the strict verifier of each task
    (``strict_verifier`` of its temperature) as a dashed line of the same colour."""
    sweeps = setting_sweeps(summary)
    if not sweeps:
        raise NotEnoughData("the threshold ablation needs a verifier whose cells differ in one setting only, "
                            "a number at two or more values")  # fmt: skip
    strict = summary[summary["verifier"] == summary["temperature"].map(strict_verifier)]
    figure, axes = plt.subplots(len(ABLATION_PANELS), len(sweeps), sharex="col", squeeze=False,
                                figsize=(6.4 * len(sweeps), 9.5), layout="constrained")  # fmt: skip
    swept = pd.concat([_sweep_panels(axes[:, column], summary, sweep, strict) for column, sweep in enumerate(sweeps)])
    for axis, (_metric, label, _ci) in zip(axes[:, 0], ABLATION_PANELS):
        axis.set_ylabel(label, fontsize=8)
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(handles.values(), handles.keys(), fontsize=7, ncol=2, loc="outside lower center")  # over no line
    prompts = int(swept["prompts"].max())
    figure.suptitle(f"Threshold ablation ({prompts} prompts per task; bars: bootstrap 95% CI)\n{_title(swept)}", fontsize=9)
    return _save(figure, path)


def _sweep_panels(axes: np.ndarray, summary: pd.DataFrame, sweep: Sweep, strict: pd.DataFrame) -> pd.DataFrame:
    """Draw one sweep's column of ``ABLATION_PANELS`` into ``axes``; its rows of ``summary`` (``SWEPT``: their value)."""
    values = sweep.values(summary)
    rows = summary[values.notna()].assign(**{SWEPT: values[values.notna()]})
    for color, ((task, conditions), group) in zip(plt.cm.tab10.colors, rows.groupby(["task", "conditions"], sort=True)):
        group = group.sort_values(SWEPT)
        where = ", ".join(filter(None, (task, conditions)))  # runs of one task with other baseline conditions: lines apart
        reference = strict[(strict["task"] == task) & (strict["conditions"] == conditions)]
        for axis, (metric, _label, with_ci) in zip(axes, ABLATION_PANELS):
            errors = _error_bars(group[metric], group[f"{metric}_ci_low"], group[f"{metric}_ci_high"]) if with_ci else None
            axis.errorbar(group[SWEPT], group[metric], yerr=errors, marker="o", capsize=3, color=color,
                          label=f"{sweep.verifier}, {where}")  # fmt: skip
            if len(reference) and metric != "trigger_rate":
                axis.axhline(reference[metric].iloc[0], color=color, linestyle="--", linewidth=1,
                             label=f"{reference['verifier'].iloc[0]} (strict), {where}")  # fmt: skip
    _speedup_reference(axes[0])
    if rows["speedup"].isna().all():  # every cell of the sweep lost its speedup: say why where the lines would be
        _no_data(axes[0], missing_speedups(pd.concat([rows, strict]).drop_duplicates(["task", "conditions", "label"])))
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel(sweep.axis)
    axes[-1].set_xticks(sorted(rows[SWEPT].unique()))
    return rows


def _speedup_reference(axis) -> None:
    """The AR baseline (1x) across a speedup panel, kept clear of its edge where every speedup lies above it."""
    axis.axhline(1.0, color="grey", linewidth=1, label="AR baseline (1x)")
    low, high = axis.get_ylim()
    pad = 0.05 * (high - low)
    axis.set_ylim(min(low, 1.0 - pad), max(high, 1.0 + pad))


def pareto_front(points: pd.DataFrame) -> pd.DataFrame:
    """The points no other point beats on both speedup and score (higher is better on both)."""
    front = []
    for index, row in points.iterrows():
        beaten = ((points["speedup"] >= row["speedup"]) & (points["score"] >= row["score"])
                  & ((points["speedup"] > row["speedup"]) | (points["score"] > row["score"])))  # fmt: skip
        if not beaten.any():
            front.append(index)
    return points.loc[front].sort_values("speedup")


SWEEP_COLOURS = ("tab:blue", "tab:green", "tab:purple", "tab:olive", "tab:cyan")  # a sweep's points; others red


def pareto(summary: pd.DataFrame, path: Path) -> Path:
    """Score against speedup for every verifier and setting, one panel per task; the front joined. A point's
    vertical bar is the paired 95% CI of its score change against its baseline (prompts where both answers
    finished), placed at its score, where it has one; else the bootstrap CI of its score. Each label says
    how many of the setting's answers finished, marked where some were cut at the budget. The points of a
    sweep (``cells.setting_sweeps``) are circles in the sweep's colour, labelled with the setting's value
    above them; every other point a red square labelled with its setting's name below it."""
    scored = summary.dropna(subset=["score", "speedup"])
    if scored.empty and summary["speedup"].isna().all():
        raise NotEnoughData(missing_speedups(summary))
    if scored.empty:
        raise NotEnoughData("the Pareto front needs settings with both a speedup and a score")
    sweeps = setting_sweeps(summary)
    colours = dict(zip((sweep.verifier for sweep in sweeps), itertools.cycle(SWEEP_COLOURS)))
    scored = scored.assign(**{SWEPT: _swept_values(scored, sweeps)})
    tasks = sorted(scored["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.4), squeeze=False, layout="constrained")
    for axis, task in zip(axes[0], tasks):
        rows = scored[scored["task"] == task]
        for _, row in rows.iterrows():
            _pareto_point(axis, rows.loc[[row.name]], sweeps, colours)
        front = pareto_front(rows)
        axis.plot(front["speedup"], front["score"], color="black", linewidth=1, marker="o", markersize=11,
                  markerfacecolor="none", label="Pareto front (ringed)")  # fmt: skip
        axis.set_title(task)
        axis.set_xlabel("speedup over AR baseline (x)")
        axis.set_ylabel("task score (mean per prompt)")
        axis.grid(alpha=0.3)
        for sweep in sweeps:
            axis.plot([], [], "o", color=colours[sweep.verifier], label=f"{sweep.verifier} at {sweep.setting}")
        axis.plot([], [], "s", color="tab:red", label="other verifiers")
        axis.legend(fontsize=7)
    figure.suptitle(f"Speed against quality (bars: speedup bootstrap 95% CI; score: paired 95% CI of the change against "
                    f"the baseline over prompts where both answers finished, {CUT_MARK}: some answers cut at the budget)"
                    f"\n{_title(scored)}", fontsize=9)  # fmt: skip
    return _save(figure, path)


def _swept_values(table: pd.DataFrame, sweeps: list[Sweep]) -> pd.Series:
    """Each row's value of its verifier's swept setting; NaN for a row of no sweep (or where the value is no number)."""
    values = pd.Series(np.nan, index=table.index, dtype=float)
    for sweep in sweeps:
        values = values.fillna(sweep.values(table))
    return values


def _pareto_point(axis, one: pd.DataFrame, sweeps: list[Sweep], colours: dict[str, str]) -> None:
    """One setting (``one``: its row, with ``SWEPT``) as a point with its bars and its label."""
    row = one.iloc[0]
    swept = pd.notna(row[SWEPT])
    axis.errorbar(row["speedup"], row["score"], marker="o" if swept else "s",
                  color=colours[row["verifier"]] if swept else "tab:red",
                  xerr=_error_bars(one["speedup"], one["speedup_ci_low"], one["speedup_ci_high"]),
                  yerr=_error_bars(one["score"], *_score_bar(one)),
                  alpha=0.5, capsize=2)  # fmt: skip  # a CI that collapses onto its point may lie a rounding error beyond it
    setting = next((sweep.setting for sweep in sweeps if sweep.verifier == row["verifier"]), "")
    text = f"{setting}={row[SWEPT]:g}" if swept else row["label"]  # a sweep's values above their point, names below
    if row.get("answers"):
        cut = " " + CUT_MARK if row["finished"] < row["answers"] else ""
        text += f" ({int(row['finished'])}/{int(row['answers'])} finished{cut})"
    axis.annotate(text, (row["speedup"], row["score"]), fontsize=7, xytext=(4, 4 if swept else -10), textcoords="offset points")


def _score_bar(one: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """The low and high end of a point's score bar: its score shifted by the paired CI of its change against
    the baseline, where it has one; else its score's own bootstrap CI."""
    if "score_change" in one and one["score_change"].notna().all():
        shift = one["score"] - one["score_change"]
        return shift + one["score_change_ci_low"], shift + one["score_change_ci_high"]
    return one["score_ci_low"], one["score_ci_high"]


def alpha_by_depth(alpha: pd.DataFrame, path: Path) -> Path:
    """alpha_d (accepted / reached at draft depth d) per method with its bootstrap 95% CI over prompts, one
    column of panels per task; under it, how many drafts reached each depth. The alpha axes are shared
    and run from the tenth below the lowest interval up to 1 (every draft accepted), so that no panel
    magnifies differences smaller than its own intervals."""
    tasks = sorted(alpha["task"].unique())
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 6.8), squeeze=False, sharex=True, sharey="row",
                                height_ratios=[2, 1], layout="constrained")  # fmt: skip
    labels = sorted(alpha["label"].unique())
    width = 0.5 / max(len(labels), 1)  # the methods side by side at each depth, so that their bars do not hide each other
    for (rate_axis, count_axis), task in zip(axes.T, tasks):
        for color, label in zip(itertools.cycle(plt.cm.tab10.colors), labels):  # every method, colours repeating past 10
            rows = alpha[(alpha["task"] == task) & (alpha["label"] == label)]
            if rows.empty:
                continue
            x = rows["depth"] + (labels.index(label) - (len(labels) - 1) / 2) * width
            errors = _error_bars(rows["alpha"], rows["alpha_ci_low"], rows["alpha_ci_high"])
            rate_axis.errorbar(x, rows["alpha"], yerr=errors, marker="o", markersize=4, capsize=2, color=color, label=label)
            count_axis.plot(x, rows["reached"], marker=".", color=color, label=label)
        rate_axis.set_title(task)
        count_axis.set_xlabel("draft depth d")
        count_axis.set_xticks(sorted(alpha["depth"].unique()))
        for axis in (rate_axis, count_axis):
            axis.grid(alpha=0.3)
    lowest = pd.concat([alpha["alpha_ci_low"], alpha["alpha"]]).min()
    bottom = max(0.0, np.floor(lowest * 10) / 10) if pd.notna(lowest) else 0.0
    axes[0][0].set_ylim(bottom - 0.01, 1.01)  # a margin at both ends, so that a point at 0 or 1 shows whole
    axes[1][0].set_ylim(0, alpha["reached"].max() * 1.08)
    axes[0][0].set_ylabel("alpha_d = accepted / reached at depth d", fontsize=9)
    axes[1][0].set_ylabel("drafts reaching depth d", fontsize=9)
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}  # every task's
    figure.legend(handles.values(), handles.keys(), fontsize=7, ncol=min(len(handles), 4), loc="outside lower center")
    prompts = int(alpha["prompts"].max())
    figure.suptitle(f"Acceptance per draft depth (up to {prompts} prompts per method; bars: bootstrap 95% CI over "
                    f"prompts)\n{_title(alpha)}", fontsize=9)  # fmt: skip
    return _save(figure, path)


def margin_histograms(table: pd.DataFrame, path: Path, low: float = 0.5) -> Path:
    """Distribution of z2 / z1 at strict accepts, relaxed accepts and rejections, per method; a dotted line at
    the lowest margin where the method relaxed (where that lies on the axis)."""
    labels = sorted(table["label"].unique())
    columns = min(3, len(labels))
    rows_count = -(-len(labels) // columns)
    size = (4.6 * columns, 3.4 * rows_count)
    figure, axes = plt.subplots(rows_count, columns, figsize=size, squeeze=False, sharex=True, layout="constrained")
    bins = np.linspace(low, 1.0, 26)
    colors = {"strict accept": "tab:green", "relaxed accept": "tab:orange", "rejected": "tab:red"}
    for axis, label in zip(axes.flat, labels):
        rows = table[(table["label"] == label)].dropna(subset=["margin"])
        for outcome, color in colors.items():
            margins = rows.loc[rows["outcome"] == outcome, "margin"].clip(low, 1.0)
            if len(margins):
                axis.hist(margins, bins=bins, histtype="step", linewidth=1.5, color=color, label=f"{outcome} (n={len(margins)})")
        relaxed = rows.loc[rows["outcome"] == "relaxed accept", "margin"]
        if len(relaxed) and relaxed.min() >= low:  # where the verifier began to relax, whichever its rule
            axis.axvline(relaxed.min(), color="black", linestyle=":", linewidth=1, label=f"lowest relaxed {relaxed.min():.3g}")
        _log_counts(axis)
        axis.set_title(label, fontsize=9)
        axis.legend(fontsize=6)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(labels) :]:
        axis.set_visible(False)
    for axis in axes[-1]:
        axis.set_xlabel(f"margin z2 / z1 (values below {low} drawn at {low})")
    for axis in axes[:, 0]:
        axis.set_ylabel("verified positions (log)")
    figure.suptitle(f"Margin statistic by verification outcome, all tasks pooled\n{_title(table)}", fontsize=9)
    return _save(figure, path)


def acceptance_by_margin_plot(binned: pd.DataFrame, path: Path) -> Path:
    """Acceptance rate of verified positions per margin bin, per method (tasks pooled), with counts."""
    pooled = binned.assign(accepted=binned["positions"] * binned["acceptance_rate"])
    pooled = pooled.groupby(["label", "bin_low", "bin_high"], as_index=False)[["positions", "accepted"]].sum()
    pooled["acceptance_rate"] = pooled["accepted"] / pooled["positions"]
    figure, (rate_axis, count_axis) = plt.subplots(
        2, 1, sharex=True, figsize=(7, 6.5), height_ratios=[2, 1], layout="constrained"
    )
    edges = sorted(set(pooled["bin_low"]) | set(pooled["bin_high"]))
    finite = [e for e in edges if np.isfinite(e)]
    order = {edge: i for i, edge in enumerate(sorted(set(pooled["bin_low"])))}
    names = [f"<{finite[0]:g}" if not np.isfinite(low) else (f">={low:g}" if not np.isfinite(high) else f"{low:g}-{high:g}")
             for low, high in sorted(set(zip(pooled["bin_low"], pooled["bin_high"])))]  # fmt: skip
    for label, rows in pooled.groupby("label", sort=True):
        x = [order[b] for b in rows["bin_low"]]
        rate_axis.plot(x, rows["acceptance_rate"], marker="o", label=label)
        count_axis.plot(x, rows["positions"], marker=".", label=label)
    rate_axis.set_ylabel("acceptance rate of verified positions")
    rate_axis.legend(fontsize=7)
    rate_axis.grid(alpha=0.3)
    count_axis.set_ylabel("positions in bin (log)")
    _log_counts(count_axis)
    count_axis.grid(alpha=0.3)
    count_axis.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
    count_axis.set_xlabel("margin bin z2 / z1")
    figure.suptitle(f"Acceptance by margin, all tasks pooled\n{_title(binned)}", fontsize=9)
    return _save(figure, path)


FRONTIER_GROUP = ["model", "drafter", "task", "temperature"]


def _pool_rules(table: pd.DataFrame) -> pd.DataFrame:
    """The fidelity table's rows of one panel pooled per rule, weighted by positions (and tau by steps):
    a rule judged in several settings (a shadow of every cell of a sweep) becomes one point."""
    sums = table.assign(
        accept=table["acceptance"] * table["positions"],
        kl=table["kl_per_position"] * table["positions"],
        tv=table["tv_per_position"] * table["positions"],
        draft_tv=table["draft_tv_per_position"] * table["positions"],
        kept=(table["expected_tau"] - 1.0) * table["steps"],
    )
    columns = ["positions", "accept", "kl", "tv", "draft_tv", "steps", "kept"]
    pooled = sums.groupby(["rule", "family", "parameters"], sort=False)[columns].agg(lambda s: s.sum(skipna=False))
    out = pooled.reset_index()
    for name in ("accept", "kl", "tv", "draft_tv"):
        out[name] = out[name] / out["positions"]
    out["expected_tau"] = 1.0 + out["kept"] / out["steps"]
    return out


def _kl_axis(axis, values: pd.Series) -> float:
    """A symlog x axis for KL per position: lossless rules (KL at rounding level) sit at 0."""
    positive = values[values > 1e-8]
    threshold = 10.0 ** np.floor(np.log10(positive.min())) if len(positive) else 1e-3
    axis.set_xscale("symlog", linthresh=threshold)
    axis.set_xlim(left=0)
    return threshold


def _rule_lines(axis, points: pd.DataFrame, x: str, y: str, strict: str) -> None:
    """One line per rule family across its parameter values (sorted by x), parameters written at
    the points; the strict rule as a black star."""
    for color, (family, rows) in zip(plt.cm.tab10.colors, points[points["family"] != strict].groupby("family", sort=True)):
        rows = rows.dropna(subset=[x, y]).sort_values(x)
        if rows.empty:
            continue
        axis.plot(rows[x], rows[y], marker="o", color=color, label=family)
        for _, row in rows.iterrows():
            if row["parameters"]:
                axis.annotate(row["parameters"], (row[x], row[y]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    reference = points[points["family"] == strict].dropna(subset=[x, y])
    if len(reference):
        axis.plot(reference[x], reference[y], marker="*", markersize=12, linestyle="none", color="black", clip_on=False,
                  label=f"{strict} (strict)", zorder=3)  # fmt: skip


def frontier(table: pd.DataFrame, path: Path) -> Path:
    """Expected acceptance against mean KL(P_V || p) and mean TV(P_V, p) per position, and expected
    tau against the KL (against TV in greedy mode, where KL is undefined): one row of panels per
    (target, drafter, task, temperature), each rule family a line over its parameters, the strict
    rule a star. The bounds use the panel's mean TV(q, p) of the drafts: alpha <= 1 - TV(q, p) + t
    on the TV panel (exact per position, hence on means), and alpha <= 1 - TV(q, p) + sqrt(KL / 2)
    on the KL panel (Pinsker, then Jensen: valid, loose)."""
    if table.empty:
        raise NotEnoughData("no fidelity rows to draw")
    groups = list(table.groupby(FRONTIER_GROUP, sort=True))
    figure, axes = plt.subplots(len(groups), 3, figsize=(15, 4.3 * len(groups)), squeeze=False, layout="constrained")
    for (key, rows), (kl_axis, tv_axis, tau_axis) in zip(groups, axes):
        model, drafter, task, temperature = key
        points = _pool_rules(rows)
        strict = rows["strict"].iloc[0]
        draft_tv = points["draft_tv"].dropna()
        draft_tv = float((draft_tv * points.loc[draft_tv.index, "positions"]).sum()
                         / points.loc[draft_tv.index, "positions"].sum()) if len(draft_tv) else np.nan  # fmt: skip
        with_kl = bool(points["kl"].notna().any())
        if with_kl:
            threshold = _kl_axis(kl_axis, points["kl"])
            if np.isfinite(draft_tv):
                kl = np.concatenate([[0.0], np.geomspace(threshold / 10, points["kl"].max() * 1.05, 200)])
                kl_axis.plot(kl, np.minimum(1.0, 1.0 - draft_tv + np.sqrt(kl / 2)), color="grey", linestyle="--",
                             label="bound 1 - TV(q,p) + sqrt(KL/2) (Pinsker, loose)")  # fmt: skip
            _rule_lines(kl_axis, points, "kl", "accept", strict)
            _kl_axis(tau_axis, points["kl"])
            tau_axis.set_xlabel("mean KL(P_V || p) per position, nats (symlog)", fontsize=8)
        else:  # greedy: KL is undefined, tau goes against TV (the share of positions off the target's argmax)
            kl_axis.text(0.5, 0.5, "no finite KL (greedy: p is one-hot)", ha="center", va="center", transform=kl_axis.transAxes)
            tau_axis.set_xlabel("mean TV(P_V, p) per position", fontsize=8)
        _rule_lines(tau_axis, points, "kl" if with_kl else "tv", "expected_tau", strict)
        if not tau_axis.lines:
            tau_axis.text(0.5, 0.5, "no expected tau (trees)", ha="center", va="center", transform=tau_axis.transAxes)
        if np.isfinite(draft_tv):
            tv = np.linspace(0.0, max(float(points["tv"].max()), 1e-3) * 1.05, 50)
            tv_axis.plot(tv, np.minimum(1.0, 1.0 - draft_tv + tv), color="grey", linestyle="--",
                         label="bound 1 - TV(q,p) + TV(P_V,p)")  # fmt: skip
        _rule_lines(tv_axis, points, "tv", "accept", strict)
        where = f"{task}, {model}, {_drafter_title(str(drafter))}, T = {temperature:g}"
        kl_axis.set_ylabel(f"{where}\nexpected acceptance per drafted position", fontsize=8)
        tau_axis.set_ylabel("expected tau (tokens per step)", fontsize=8)
        kl_axis.set_xlabel("mean KL(P_V || p) per position, nats (symlog; lossless at 0)", fontsize=8)
        tv_axis.set_xlabel("mean TV(P_V, p) per position", fontsize=8)
        for axis in (kl_axis, tv_axis, tau_axis):
            axis.grid(alpha=0.3)
            if axis.lines:
                axis.legend(fontsize=6, loc="best")
    records = int(table.loc[table["role"] == "live", "prompts"].sum())
    figure.suptitle(f"Acceptance against fidelity to the target ({records} records; "
                    f"rules pooled over the settings whose drafts judged them)\n{_title(table)}", fontsize=9)  # fmt: skip
    return _save(figure, path)


def batching(table: pd.DataFrame, model: pd.DataFrame | None, gains: pd.DataFrame | None, path: Path) -> Path:
    """Against the batch size B (log 2 axis), one colour per task and one line style per rule: the
    throughput speedup over the baseline at the same B (hollow: the cost model's prediction for the run's
    batches; dotted: its extrapolation to every timed B), the per-request latency speedup, tau with its
    95% CI (flat if batching leaves acceptance alone), and each lossy rule's gain over the strict rule
    (live: its speedup over the strict rule's; dotted, shadows: tokens per step on the strict rule's drafts)."""
    if table.empty:
        raise NotEnoughData("no batching rows to draw")
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5), layout="constrained")
    (speed_axis, latency_axis), (tau_axis, gain_axis) = axes
    colours = dict(zip(sorted(table["task"].unique()), itertools.cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"])))
    styles = dict(zip(sorted(table["rule"].unique()), itertools.cycle(["-", "--", "-.", ":"])))
    markers = dict(zip(sorted(table["rule"].unique()), itertools.cycle("osD^v")))
    for (task, rule), rows in table.groupby(["task", "rule"], sort=True):
        rows = rows.sort_values("batch_size")
        look = {"color": colours[task], "linestyle": styles[rule], "marker": markers[rule], "label": f"{task}, {rule}"}
        speed_axis.plot(rows["batch_size"], rows["speedup"], **look)
        if "predicted_speedup" in rows and rows["predicted_speedup"].notna().any():
            speed_axis.plot(rows["batch_size"], rows["predicted_speedup"], color=colours[task], marker=markers[rule],
                            linestyle="none", fillstyle="none", markersize=10)  # fmt: skip
        latency_axis.plot(rows["batch_size"], rows["latency_speedup"], **look)
        if "predicted_latency_speedup" in rows and rows["predicted_latency_speedup"].notna().any():
            latency_axis.plot(rows["batch_size"], rows["predicted_latency_speedup"], color=colours[task], marker=markers[rule],
                              linestyle="none", fillstyle="none", markersize=10)  # fmt: skip
        tau_axis.errorbar(rows["batch_size"], rows["tau"], yerr=_error_bars(rows["tau"], rows["tau_ci_low"], rows["tau_ci_high"]),
                          capsize=3, **look)  # fmt: skip
        if not np.allclose(rows["gain_over_strict"].dropna(), 1.0):
            live = {**look, "label": f"{task}, {rule} live: speedup / strict's"}
            gain_axis.plot(rows["batch_size"], rows["gain_over_strict"], **live)
    if model is not None:
        for (task, _rule), rows in model.groupby(["task", "rule"], sort=True):
            rows = rows.sort_values("batch_size")
            speed_axis.plot(rows["batch_size"], rows["modelled_speedup"], color=colours.get(task, "grey"), linestyle=":",
                            linewidth=1, alpha=0.8)  # fmt: skip
    strict = set(table["rule"][table["rule"] == table["temperature"].map(strict_verifier)])
    if gains is not None and not gains.empty:
        for (task, live, shadow), rows in gains[gains["live"].isin(strict)].groupby(["task", "live", "shadow"], sort=True):
            rows = rows.sort_values("batch_size")
            gain_axis.plot(rows["batch_size"], rows["tau_gain"], color=colours.get(task, "grey"), linestyle=":", marker=".",
                           label=f"{task}, {shadow} (shadow): tokens per step / {live}'s")  # fmt: skip
    for axis, label in ((speed_axis, "throughput speedup over AR at the same B"),
                        (latency_axis, "per-request latency speedup over AR at the same B"),
                        (tau_axis, "tau (tokens per verification step, pooled; 95% CI)"),
                        (gain_axis, "gain over the strict rule")):  # fmt: skip
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _position: f"{value:g}"))
        axis.set_xlabel("batch size B", fontsize=8)
        axis.set_ylabel(label, fontsize=8)
        axis.grid(alpha=0.3)
        if axis is not tau_axis:
            axis.axhline(1.0, color="black", linewidth=0.8)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=6, loc="best")
    if model is not None or ("predicted_speedup" in table and table["predicted_speedup"].notna().any()):
        speed_axis.set_title("hollow: the cost model for the run's batches; dotted: the cost model at every timed B", fontsize=7)
        latency_axis.set_title("hollow: the cost model for the run's batches", fontsize=7)
    if not gain_axis.get_legend_handles_labels()[0]:
        _no_data(gain_axis, "no lossy rule beside a strict one (live or as a shadow)")
    figure.suptitle(f"Speculative decoding at batch B ({int(table['prompts'].max())} prompts per point)\n{_title(table)}",
                    fontsize=9)  # fmt: skip
    return _save(figure, path)
