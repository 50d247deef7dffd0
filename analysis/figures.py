"""Figures (PNG, matplotlib's Agg backend): the threshold ablation (any verifier's swept setting), the speed-quality Pareto
front, alpha per depth, each value statistic's histograms by outcome and acceptance by its bin, the fidelity
frontier (expected acceptance against KL and TV to the target) and the speed-safety frontier.

Every figure takes the tidy tables of cells.py / acceptance.py / fidelity.py / safety.py, never raw records. A figure
names settings by short keys (``mars 2``, ``fly 0.3``) and writes the key table beside it
(``key_path``: ``NAME_key.md``, each key's full setting); legends sit outside the panels, a panel is
drawn only where it has data, and the labels at points are placed where they cover no other text.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from mars_bench.bench.summary import CUT_MARK, RATE, rule_rate_columns  # noqa: E402
from mars_bench.common.strict_rule import strict_verifier  # noqa: E402

from .cells import INCLUDE_CUT, NotEnoughData, Sweep, missing_speedups, setting_sweeps  # noqa: E402
from .fidelity import KL_ZERO, natural_key  # noqa: E402

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


def _suptitle(figure: Figure, text: str, fontsize: float = 9) -> None:
    """``figure``'s title, each line wrapped to the figure's width (a long line would run past the panels,
    over the legend beside them)."""
    characters = max(40, int(figure.get_figwidth() * 72 / (0.55 * fontsize)))
    figure.suptitle("\n".join(textwrap.fill(line, characters) for line in text.split("\n")), fontsize=fontsize)


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


Labels = dict[Axes, list[tuple[float, float, str]]]  # per panel, its points' labels: (x, y, text) in data coordinates
MARKER_PX = 5.0  # half the side of the square a point's marker covers, in pixels at the figure's dpi
GAP_PX = 3.0  # between a label and its point (first ring), and the step from one ring of places to the next
RINGS = 40  # rings of candidate places around a point: the farthest lies about 40 steps away
COINCIDENT_PX = 4.0  # points this close draw as one: their keys share one label


def key_path(path: Path) -> Path:
    """Where a figure's key table lies: ``pareto.png`` -> ``pareto_key.md``."""
    return path.with_name(f"{path.stem}_key.md")


def setting_name(label: str) -> str:
    """A label's verifier (or rule family): ``mars (theta=0.9), confidence length`` -> ``mars``."""
    return label.split(" (", 1)[0].split(", ", 1)[0]


def _only_value(label: str, longest: int = 6) -> str | None:
    """The value of the one setting a label names in its brackets, where it is short: ``mars (theta=0.84)``
    -> ``0.84``; None for a label with no such bracket, with several settings, or a long value."""
    inside = label.partition(" (")[2].partition(")")[0]
    _key, equals, value = inside.partition("=")
    return value if equals and "," not in inside and 0 < len(value) <= longest else None


def short_keys(labels: Iterable[str]) -> dict[str, str]:
    """Each label's short key: its verifier's name where no other label has that name; else the name and
    its one setting's value (``mars 0.84``, where every label of the name differs from the others by it and
    nothing else), or the name and a number in the labels' natural order (``mars 2``; ``batch_size=4`` before
    ``batch_size=16``)."""
    by_name: dict[str, list[str]] = {}
    for label in sorted(set(labels), key=natural_key):
        by_name.setdefault(setting_name(label), []).append(label)
    keys = {}
    for name, mine in by_name.items():
        values = [_only_value(label) for label in mine]
        rests = {label.partition(")")[2] for label in mine}
        if len(mine) == 1:
            keys[mine[0]] = name
        elif None not in values and len(set(values)) == len(mine) and len(rests) == 1:
            keys.update({label: f"{name} {value}" for label, value in zip(mine, values)})
        else:
            keys.update({label: f"{name} {number}" for number, label in enumerate(mine, 1)})
    return keys


def write_key(path: Path, what: str, header: list[str], rows: list[list[str]]) -> Path:
    """The key table of the figure at ``path`` (``key_path``): a line saying what its keys name, then
    ``header`` and ``rows`` as a Markdown table."""
    cells = [[str(cell).replace("|", "\\|") for cell in row] for row in [header, *rows]]
    lines = [f"Key to [{path.name}]({path.name}): {what}", "", "| " + " | ".join(cells[0]) + " |",
             "|" + "---|" * len(header), *("| " + " | ".join(row) + " |" for row in cells[1:])]  # fmt: skip
    key_path(path).write_text("\n".join(lines) + "\n")
    return key_path(path)


def _merged(keys: list[str], width: int = 28) -> str:
    """The keys of points drawn on one another as one label, a name's numbers together
    (``fsd 1,2; mars_ref``), wrapped to ``width`` characters."""
    numbers: dict[str, list[str]] = {}
    for key in sorted(dict.fromkeys(keys), key=lambda key: _by_key(("", key))):
        name, _, number = key.partition(" ")
        numbers.setdefault(name, []).append(number)
    parts = [name + ("\u00a0" + ",".join(found) if any(found) else "") for name, found in numbers.items()]  # a key on one line
    return textwrap.fill("; ".join(parts), width, break_long_words=False).replace("\u00a0", " ")


def _legend_outside(figure: Figure, fontsize: float = 7, **options) -> None:
    """One legend for every panel of ``figure`` (each label once), right of the panels."""
    handles: dict[str, object] = {}
    for axis in figure.axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        figure.legend(handles.values(), handles.keys(), fontsize=fontsize, loc="outside right center", **options)


def _freeze(figure: Figure) -> None:
    """Lay ``figure`` out once and keep that layout: labels placed in pixels then stay where they were put."""
    figure.draw_without_rendering()
    figure.set_layout_engine("none")


def _place_labels(figure: Figure, labels: Labels, fontsize: float = 6.5) -> None:
    """Write every panel's labels beside their points, once the rest of ``figure`` is drawn (``_freeze``)."""
    if not any(labels.values()):
        return
    _freeze(figure)
    for axis, points in labels.items():
        _label_points(axis, points, fontsize)


def _label_points(axis: Axes, points: list[tuple[float, float, str]], fontsize: float) -> None:
    """Each label at the nearest place beside its point that stays inside the panel and covers no other
    label, point or leader line, joined to its point by a thin line (crossing no label) where it had to move
    away; the labels of points drawn on one another (``COINCIDENT_PX``) as one (``_merged``)."""
    renderer = axis.figure.canvas.get_renderer()
    frame = axis.get_window_extent(renderer)
    inner = np.array([frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2])
    at = axis.transData.transform(np.array([(x, y) for x, y, _ in points], dtype=float).reshape(-1, 2))
    shown = np.isfinite(at).all(axis=1) & (at[:, 0] >= inner[0]) & (at[:, 0] <= inner[2])
    shown &= (at[:, 1] >= inner[1]) & (at[:, 1] <= inner[3])
    kept = [(xy, point) for xy, point, show in zip(at, points, shown) if show]
    taken = Taken([np.concatenate([xy - MARKER_PX, xy + MARKER_PX]) for xy, _ in kept])  # no label covers a point
    for xy, point, text in _groups(kept):
        probe = axis.text(0, 0, text, fontsize=fontsize)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        box, ring, direction = _free_place(xy, extent.width + 2, extent.height + 2, taken, inner)
        centre = (box[:2] + box[2:]) / 2
        taken.add(box, xy if ring > 0 else None)
        arrow = {"arrowprops": {"arrowstyle": "-", "color": "0.45", "linewidth": 0.5, "shrinkA": 0, "shrinkB": 2,
                                "relpos": tuple(0.5 - 0.5 * np.sign(np.round(direction, 1)))}} if ring > 0 else {}  # fmt: skip
        axis.annotate(text, point, xytext=tuple((centre - xy) * 72 / axis.figure.dpi), textcoords="offset points",
                      fontsize=fontsize, ha="center", va="center", zorder=6, **arrow)  # fmt: skip


LEADER_SAMPLES = np.linspace(0.1, 0.9, 9)[:, None]  # where a leader line is tested against the labels it might cross


class Taken:
    """What a new label must keep clear of, in pixels: the points' markers and the labels placed (boxes as
    x0, y0, x1, y1), and points along the leader lines drawn."""

    def __init__(self, markers: list[np.ndarray]) -> None:
        self.boxes = np.array(markers, dtype=float).reshape(-1, 4)
        self.labels = np.empty((0, 4))
        self.leaders = np.empty((0, 2))

    def add(self, box: np.ndarray, point: np.ndarray | None) -> None:
        """A label placed at ``box``, with its leader line from ``point`` where it has one."""
        self.boxes = np.vstack([self.boxes, box])
        self.labels = np.vstack([self.labels, box])
        if point is not None:
            centre = (box[:2] + box[2:]) / 2
            self.leaders = np.vstack([self.leaders, point + LEADER_SAMPLES * (centre - point)])


def _inside(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Per point of ``points`` (..., 2), whether it lies in any of ``boxes`` (n, 4)."""
    x, y = points[..., 0, None], points[..., 1, None]
    return ((x > boxes[:, 0]) & (x < boxes[:, 2]) & (y > boxes[:, 1]) & (y < boxes[:, 3])).any(axis=-1)


def _groups(kept: list[tuple[np.ndarray, tuple[float, float, str]]]) -> list[tuple[np.ndarray, tuple[float, float], str]]:
    """Points within ``COINCIDENT_PX`` of a group's first point join it: (its pixel place, its data place, their label)."""
    groups: list[tuple[np.ndarray, tuple[float, float], list[str]]] = []
    for xy, (x, y, text) in kept:
        near = next((group for group in groups if np.abs(group[0] - xy).max() <= COINCIDENT_PX), None)
        if near is None:
            groups.append((xy, (x, y), [text]))
        else:
            near[2].append(text)
    return [(xy, point, _merged(texts) if len(texts) > 1 else texts[0]) for xy, point, texts in groups]


def _ring(ring: int) -> np.ndarray:
    """The directions of ring ``ring``'s 8 (ring + 1) candidate places, starting up and right, scaled onto a
    square (a box at 45 degrees sits off the point's corner, not over it)."""
    angles = np.pi / 4 + np.linspace(0, 2 * np.pi, 8 * (ring + 1), endpoint=False)
    direction = np.column_stack([np.cos(angles), np.sin(angles)])
    return direction / np.abs(direction).max(axis=1, keepdims=True)


RING_DIRECTIONS = [_ring(ring) for ring in range(RINGS)]


Place = tuple[np.ndarray, int, np.ndarray]  # a label's box (x0, y0, x1, y1), its ring, its direction from its point


def _free_place(xy: np.ndarray, width: float, height: float, taken: Taken, inner: np.ndarray) -> Place:
    """The first box of ``width`` x ``height`` pixels, ring by ring outward from the point at ``xy``, that lies
    inside ``inner``, overlaps nothing ``taken`` and whose leader line crosses no label; where none is free,
    the one with the fewest such conflicts. Returns the box, its ring (0: the nearest, drawn without a
    leader) and its direction from the point."""
    best: tuple[float, Place] | None = None
    half = np.array([width, height]) / 2
    for ring, direction in enumerate(RING_DIRECTIONS):
        centre = xy + direction * (half + GAP_PX + MARKER_PX + 2 * GAP_PX * ring)
        boxes = np.column_stack([centre - half, centre + half])
        cost = _conflicts(boxes, taken, xy, centre, leader=ring > 0)
        inside = (boxes[:, 0] >= inner[0]) & (boxes[:, 1] >= inner[1]) & (boxes[:, 2] <= inner[2]) & (boxes[:, 3] <= inner[3])
        cost = cost + np.where(inside, 0, 1000)  # a place outside the panel only where there is none inside
        first = int(np.argmin(cost))
        if cost[first] == 0:
            return boxes[first], ring, direction[first]
        if best is None or cost[first] < best[0]:
            best = (cost[first], (boxes[first], ring, direction[first]))
    return best[1]


def _conflicts(boxes: np.ndarray, taken: Taken, xy: np.ndarray, centre: np.ndarray, leader: bool) -> np.ndarray:
    """Per candidate box (x0, y0, x1, y1): the markers and labels it overlaps, whether it covers a leader line
    drawn before, and (with a ``leader`` from the point at ``xy`` to its ``centre``) whether that crosses a label."""
    other = taken.boxes
    overlaps = ((boxes[:, None, 0] < other[None, :, 2]) & (boxes[:, None, 2] > other[None, :, 0])
                & (boxes[:, None, 1] < other[None, :, 3]) & (boxes[:, None, 3] > other[None, :, 1])).sum(axis=1)  # fmt: skip
    x, y = taken.leaders[:, 0], taken.leaders[:, 1]
    covers = ((x > boxes[:, :1]) & (x < boxes[:, 2:3]) & (y > boxes[:, 1:2]) & (y < boxes[:, 3:])).any(axis=1)
    if not leader:
        return overlaps + covers
    crosses = _inside(xy + LEADER_SAMPLES[None, :, :] * (centre - xy)[:, None, :], taken.labels).any(axis=1)
    return overlaps + covers + crosses


ABLATION_PANELS = [  # (metric, y label, with its CI); then a panel per rate of a statistic the verifiers declare
    ("speedup", "speedup over AR baseline (x)", True),
    ("tau", "tau (tokens per target forward)", False),
    ("score", "task score (mean per prompt)", True),
]
SWEPT = "_swept"  # the column holding a row's value of the swept setting, in the figures' own tables


def threshold_ablation(summary: pd.DataFrame, path: Path) -> Path:
    """Speedup, tau, score and the rate of each count statistic the verifiers declare (``summary.rule_rates``: the
    trigger rate of ``mars``) against a verifier's swept setting (``cells.setting_sweeps``: the one setting that
    differs between its cells, a number), a column of panels per such verifier sharing its x axis (named
    ``verifier: setting``), one line per task (and baseline conditions); the strict verifier of each task
    (``strict_verifier`` of its temperature) as a dashed line of the same colour. A metric none of the sweeps'
    cells has (no score, no statistic) gets no panel; the speedup always has one, saying why where it is missing."""
    sweeps = setting_sweeps(summary)
    if not sweeps:
        raise NotEnoughData("the threshold ablation needs a verifier whose cells differ in one setting only, "
                            "a number at two or more values")  # fmt: skip
    strict = summary[summary["verifier"] == summary["temperature"].map(strict_verifier)]
    cells = pd.concat([summary[sweep.values(summary).notna()] for sweep in sweeps])
    rates = [(column, f"{column.removesuffix(RATE)} rate (share of verified positions)", False)
             for column in rule_rate_columns(cells)]  # fmt: skip
    panels = [panel for panel in [*ABLATION_PANELS, *rates] if panel[0] == "speedup" or cells[panel[0]].notna().any()]
    figure, axes = plt.subplots(len(panels), len(sweeps), sharex="col", squeeze=False,
                                figsize=(6.4 * len(sweeps), 2.2 * len(panels) + 0.7), layout="constrained")  # fmt: skip
    swept = pd.concat([_sweep_panels(axes[:, column], summary, sweep, strict, panels) for column, sweep in enumerate(sweeps)])
    for axis, (_metric, label, _ci) in zip(axes[:, 0], panels):
        axis.set_ylabel(label, fontsize=8)
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}
    figure.legend(handles.values(), handles.keys(), fontsize=7, ncol=2, loc="outside lower center")  # over no line
    prompts = int(swept["prompts"].max())
    _suptitle(figure, f"Threshold ablation ({prompts} prompts per task; bars: bootstrap 95% CI)\n{_title(swept)}", fontsize=9)
    return _save(figure, path)


def _sweep_panels(axes: np.ndarray, summary: pd.DataFrame, sweep: Sweep, strict: pd.DataFrame, panels: list) -> pd.DataFrame:
    """Draw one sweep's column of ``panels`` (of ``ABLATION_PANELS``) into ``axes``; its rows of ``summary``
    (``SWEPT``: their value)."""
    values = sweep.values(summary)
    rows = summary[values.notna()].assign(**{SWEPT: values[values.notna()]})
    for color, ((task, conditions), group) in zip(plt.cm.tab10.colors, rows.groupby(["task", "conditions"], sort=True)):
        group = group.sort_values(SWEPT)
        where = ", ".join(filter(None, (task, conditions)))  # runs of one task with other baseline conditions: lines apart
        reference = strict[(strict["task"] == task) & (strict["conditions"] == conditions)]
        for axis, (metric, _label, with_ci) in zip(axes, panels):
            errors = _error_bars(group[metric], group[f"{metric}_ci_low"], group[f"{metric}_ci_high"]) if with_ci else None
            axis.errorbar(group[SWEPT], group[metric], yerr=errors, marker="o", capsize=3, color=color,
                          label=f"{sweep.verifier}, {where}")  # fmt: skip
            if len(reference) and not metric.endswith(RATE):  # a statistic's rate: the strict rule has none
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
    finished), placed at its score, where it has one; else the bootstrap CI of its score. Each point is
    labelled with its setting's short key (``short_keys``), marked where some of its answers were cut at the
    budget; the key table (``key_path``) gives each key's setting and its finished answers per task. The
    points of a sweep (``cells.setting_sweeps``) are circles in the sweep's colour, every other point a red
    square."""
    scored = summary.dropna(subset=["score", "speedup"])
    if scored.empty and summary["speedup"].isna().all():
        raise NotEnoughData(missing_speedups(summary))
    if scored.empty:
        raise NotEnoughData("the Pareto front needs settings with both a speedup and a score")
    sweeps = setting_sweeps(summary)
    colours = dict(zip((sweep.verifier for sweep in sweeps), itertools.cycle(SWEEP_COLOURS)))
    scored = scored.assign(**{SWEPT: _swept_values(scored, sweeps)})
    keys = short_keys(scored["label"])
    tasks = sorted(scored["task"].unique())
    figure, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.4), squeeze=False, layout="constrained")
    labels: Labels = {}
    for axis, task in zip(axes[0], tasks):
        rows = scored[scored["task"] == task]
        labels[axis] = [_pareto_point(axis, rows.loc[[name]], colours, keys) for name in rows.index]
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
    _legend_outside(figure)
    _suptitle(figure, f"Speed against quality (bars: speedup bootstrap 95% CI; score: paired 95% CI of the change against "
                    f"the baseline over prompts where both answers finished, {CUT_MARK}: some answers cut at the budget)"
                    f"\n{_title(scored)}", fontsize=9)  # fmt: skip
    _place_labels(figure, labels)
    write_key(path, "each point's setting, and its answers that finished (of all) per task", ["key", "setting", "finished"],
              [[key, label, _finished(scored[scored["label"] == label])] for label, key in sorted(keys.items(), key=_by_key)])
    return _save(figure, path)


def _by_key(item: tuple[str, str]) -> tuple:
    """Key-table rows in the order of their keys, numbers as numbers (``mars 2`` before ``mars 10``)."""
    name, _, number = item[1].partition(" ")
    try:
        return (name, float(number), "")
    except ValueError:
        return (name, float("-inf"), number)


def _finished(rows: pd.DataFrame) -> str:
    """A setting's finished answers of all, per task (``humaneval 9/10†``), marked where some were cut."""
    if "answers" not in rows or rows["answers"].isna().all():
        return ""
    parts = []
    for _, row in rows.sort_values("task").iterrows():
        cut = CUT_MARK if row["finished"] < row["answers"] else ""
        parts.append(f"{row['task']} {int(row['finished'])}/{int(row['answers'])}{cut}")
    return ", ".join(parts)


def _swept_values(table: pd.DataFrame, sweeps: list[Sweep]) -> pd.Series:
    """Each row's value of its verifier's swept setting; NaN for a row of no sweep (or where the value is no number)."""
    values = pd.Series(np.nan, index=table.index, dtype=float)
    for sweep in sweeps:
        values = values.fillna(sweep.values(table))
    return values


def _pareto_point(axis: Axes, one: pd.DataFrame, colours: dict[str, str], keys: dict[str, str]) -> tuple[float, float, str]:
    """One setting (``one``: its row, with ``SWEPT``) as a point with its bars; its label: its key, marked
    where some of its answers were cut at the budget."""
    row = one.iloc[0]
    swept = pd.notna(row[SWEPT])
    axis.errorbar(row["speedup"], row["score"], marker="o" if swept else "s",
                  color=colours[row["verifier"]] if swept else "tab:red",
                  xerr=_error_bars(one["speedup"], one["speedup_ci_low"], one["speedup_ci_high"]),
                  yerr=_error_bars(one["score"], *_score_bar(one)),
                  alpha=0.5, capsize=2)  # fmt: skip  # a CI that collapses onto its point may lie a rounding error beyond it
    cut = CUT_MARK if row.get("answers") and row["finished"] < row["answers"] else ""
    return row["speedup"], row["score"], keys[row["label"]] + cut


def _score_bar(one: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """The low and high end of a point's score bar: its score shifted by the paired CI of its change against
    the baseline, where it has one; else its score's own bootstrap CI."""
    if "score_change" in one and one["score_change"].notna().all():
        shift = one["score"] - one["score_change"]
        return shift + one["score_change_ci_low"], shift + one["score_change_ci_high"]
    return one["score_ci_low"], one["score_ci_high"]


def _series(table: pd.DataFrame) -> pd.Series:
    """Each row's series: its label, with its temperature where the table has several (a label names no
    temperature, and rows of two would draw as one zigzag)."""
    if table["temperature"].nunique() < 2:
        return table["label"].astype(str)
    return table["label"].astype(str) + [f", T = {value:g}" for value in table["temperature"]]


def _series_keys(series: pd.Series) -> dict[str, str]:
    """Each series' short key: its label's (``short_keys``), with the temperature it carries (``_series``)."""
    labels = {name: name.rsplit(", T = ", 1) if ", T = " in name else [name] for name in series.unique()}
    keys = short_keys(parts[0] for parts in labels.values())
    return {name: keys[parts[0]] + (f", T = {parts[1]}" if len(parts) > 1 else "") for name, parts in labels.items()}


def _line_looks() -> Iterable[tuple[tuple, str]]:
    """(colour, line style) for one line after another: the ten colours solid, then dashed, then dotted."""
    return itertools.cycle((colour, style) for style in ("-", "--", ":") for colour in plt.cm.tab10.colors)


def _write_series_key(path: Path, keys: dict[str, str]) -> Path:
    """The key table of a figure of lines named by ``_series_keys``."""
    rows = [[key, name] for name, key in sorted(keys.items(), key=_by_key)]
    return write_key(path, "each line's setting", ["key", "setting"], rows)


def alpha_by_depth(alpha: pd.DataFrame, path: Path) -> Path:
    """alpha_d (accepted / reached at draft depth d) per method with its bootstrap 95% CI over prompts, one
    column of panels per task; under it, how many drafts reached each depth. The alpha axes are shared
    and run from the tenth below the lowest interval up to 1 (every draft accepted), so that no panel
    magnifies differences smaller than its own intervals. Methods by short key (``_series_keys``; the key
    table beside the figure), one line per temperature where there are several."""
    tasks = sorted(alpha["task"].unique())
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 6.8), squeeze=False, sharex=True, sharey="row",
                                height_ratios=[2, 1], layout="constrained")  # fmt: skip
    alpha = alpha.assign(series=_series(alpha))
    keys = _series_keys(alpha["series"])
    labels = sorted(keys, key=lambda name: _by_key((name, keys[name])))
    width = 0.5 / max(len(labels), 1)  # the methods side by side at each depth, so that their bars do not hide each other
    for (rate_axis, count_axis), task in zip(axes.T, tasks):
        for (color, style), label in zip(_line_looks(), labels):
            rows = alpha[(alpha["task"] == task) & (alpha["series"] == label)].sort_values("depth")
            if rows.empty:
                continue
            x = rows["depth"] + (labels.index(label) - (len(labels) - 1) / 2) * width
            errors = _error_bars(rows["alpha"], rows["alpha_ci_low"], rows["alpha_ci_high"])
            rate_axis.errorbar(x, rows["alpha"], yerr=errors, marker="o", markersize=4, capsize=2, color=color,
                               linestyle=style, label=keys[label])  # fmt: skip
            count_axis.plot(x, rows["reached"], marker=".", color=color, linestyle=style, label=keys[label])
        rate_axis.set_title(task)
        count_axis.set_xlabel("draft depth d")
        count_axis.set_xticks(sorted(alpha["depth"].unique()))
        for axis in (rate_axis, count_axis):
            axis.grid(alpha=0.3)
    lowest = pd.concat([alpha["alpha_ci_low"], alpha["alpha"]]).min()
    bottom = max(0.0, np.floor(lowest * 10) / 10) if pd.notna(lowest) else 0.0
    axes[0][0].set_ylim(bottom - 0.01, 1.01)  # room at both ends, so that a point at 0 or 1 shows whole
    axes[1][0].set_ylim(0, alpha["reached"].max() * 1.08)
    axes[0][0].set_ylabel("alpha_d = accepted / reached at depth d", fontsize=9)
    axes[1][0].set_ylabel("drafts reaching depth d", fontsize=9)
    handles = {label: handle for axis in axes[0] for handle, label in zip(*axis.get_legend_handles_labels())}  # every task's
    figure.legend(handles.values(), handles.keys(), fontsize=7, ncol=min(len(handles), 6), loc="outside lower center")
    prompts = int(alpha["prompts"].max())
    _suptitle(figure, f"Acceptance per draft depth (up to {prompts} prompts per method; bars: bootstrap 95% CI over "
                    f"prompts)\n{_title(alpha)}", fontsize=9)  # fmt: skip
    _write_series_key(path, keys)
    return _save(figure, path)


def value_histograms(table: pd.DataFrame, statistic: str, path: Path) -> Path:
    """Distribution of a value statistic (``acceptance.positions``) at strict accepts, relaxed accepts and
    rejections, per method (by short key, the key table beside the figure), between its pooled 1st and 99th
    percentiles (values beyond drawn at them); a dotted line at the lowest value where the method relaxed (where
    that lies on the axis). Each panel's legend, with its counts, right of it."""
    keys = short_keys(table["label"].astype(str))
    labels = sorted(keys, key=lambda label: _by_key((label, keys[label])))
    columns = min(3, len(labels))
    rows_count = -(-len(labels) // columns)
    size = (6.2 * columns, 3.0 * rows_count)
    figure, axes = plt.subplots(rows_count, columns, figsize=size, squeeze=False, sharex=True, layout="constrained")
    finite = table["value"][np.isfinite(table["value"])]
    low, high = (float(finite.quantile(0.01)), float(finite.quantile(0.99))) if len(finite) else (0.0, 1.0)
    high = high if high > low else low + 1.0
    bins = np.linspace(low, high, 26)
    colors = {"strict accept": "tab:green", "relaxed accept": "tab:orange", "rejected": "tab:red"}
    for axis, label in zip(axes.flat, labels):
        rows = table[(table["label"] == label)].dropna(subset=["value"])
        for outcome, color in colors.items():
            values = rows.loc[rows["outcome"] == outcome, "value"].clip(low, high)
            if len(values):
                axis.hist(values, bins=bins, histtype="step", linewidth=1.5, color=color, label=f"{outcome} (n={len(values)})")
        relaxed = rows.loc[rows["outcome"] == "relaxed accept", "value"]
        if len(relaxed) and low <= relaxed.min() <= high:  # where the verifier began to relax, whichever its rule
            axis.axvline(relaxed.min(), color="black", linestyle=":", linewidth=1, label=f"lowest relaxed {relaxed.min():.3g}")
        _log_counts(axis)
        axis.set_title(keys[label], fontsize=9)
        axis.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(labels) :]:
        axis.remove()
    for axis in axes[-1]:
        axis.set_xlabel(statistic)
    for axis in axes[:, 0]:
        axis.set_ylabel("verified positions (log)")
    _suptitle(figure, f"Statistic {statistic} by verification outcome, all tasks pooled (values beyond its 1st and 99th "
                    f"percentiles, {low:.3g} and {high:.3g}, drawn at them)\n{_title(table)}", fontsize=9)  # fmt: skip
    write_key(path, "each panel's setting", ["key", "setting"], [[keys[label], label] for label in labels])
    return _save(figure, path)


def acceptance_by_value_plot(binned: pd.DataFrame, statistic: str, path: Path) -> Path:
    """Acceptance rate of verified positions per bin of a value statistic (``acceptance.acceptance_by_value``), per
    method (by short key, the key table beside the figure; one line per temperature where there are several;
    tasks pooled), with counts."""
    pooled = binned.assign(accepted=binned["positions"] * binned["acceptance_rate"], series=_series(binned))
    pooled = pooled.groupby(["series", "bin_low", "bin_high"], as_index=False)[["positions", "accepted"]].sum()
    pooled["acceptance_rate"] = pooled["accepted"] / pooled["positions"]
    keys = _series_keys(pooled["series"])
    figure, (rate_axis, count_axis) = plt.subplots(
        2, 1, sharex=True, figsize=(7, 6.5), height_ratios=[2, 1], layout="constrained"
    )
    edges = sorted(set(pooled["bin_low"]) | set(pooled["bin_high"]))
    finite = [e for e in edges if np.isfinite(e)]
    order = {edge: i for i, edge in enumerate(sorted(set(pooled["bin_low"])))}
    names = [(f"<{finite[0]:g}" if finite else "all") if not np.isfinite(low) else
             (f">={low:g}" if not np.isfinite(high) else f"{low:g}-{high:g}")
             for low, high in sorted(set(zip(pooled["bin_low"], pooled["bin_high"])))]  # fmt: skip
    for (color, style), name in zip(_line_looks(), sorted(keys, key=lambda name: _by_key((name, keys[name])))):
        rows = pooled[pooled["series"] == name]
        x = [order[b] for b in rows["bin_low"]]
        rate_axis.plot(x, rows["acceptance_rate"], marker="o", color=color, linestyle=style, label=keys[name])
        count_axis.plot(x, rows["positions"], marker=".", color=color, linestyle=style, label=keys[name])
    rate_axis.set_ylabel("acceptance rate of verified positions")
    rate_axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    rate_axis.grid(alpha=0.3)
    count_axis.set_ylabel("positions in bin (log)")
    _log_counts(count_axis)
    count_axis.grid(alpha=0.3)
    count_axis.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    count_axis.set_xlabel(f"bin of {statistic}")
    _suptitle(figure, f"Acceptance by {statistic}, all tasks pooled\n{_title(binned)}", fontsize=9)
    _write_series_key(path, keys)
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


def _kl_axis(axis: Axes, values: pd.Series) -> None:
    """Fit ``axis``'s x axis to KL per position: linear from 0 where the positive values span a decade or
    less, else symlog with its linear stretch (where lossless rules sit, at 0) ending just below the
    smallest of them; either way ending a little room beyond the largest, so that the points fill the panel."""
    positive = values[values > KL_ZERO].dropna()
    if positive.empty:
        axis.set_xlim(-1e-4, 1e-3)
    elif positive.max() <= 10 * positive.min():
        axis.set_xlim(-0.04 * positive.max(), 1.08 * positive.max())
    else:
        threshold, right = float(positive.min()) / 2, float(positive.max()) * 1.6
        axis.set_xscale("symlog", linthresh=threshold, linscale=0.6)
        axis.set_xlim(-0.1 * threshold, right)
        decades = 10.0 ** np.arange(np.ceil(np.log10(threshold)), np.floor(np.log10(right)) + 1)
        axis.xaxis.set_major_locator(FixedLocator([0.0, *decades]))  # none inside the linear stretch, where they crowd 0


def _fit_limits(axis: Axes, values: pd.Series, which: str, room: float = 0.08) -> None:
    """``axis``'s ``which`` ("x" or "y") limits around ``values`` with ``room`` of their span at each end
    (bound lines drawn beyond them are cut at the edge)."""
    values = values.dropna()
    if values.empty:
        return
    low, high = float(values.min()), float(values.max())
    pad = room * max(high - low, 0.01 * max(abs(high), 1e-3))
    (axis.set_xlim if which == "x" else axis.set_ylim)(low - pad, high + pad)


def _rule_lines(axis: Axes, points: pd.DataFrame, x: str, y: str, strict: str, styles: dict[str, tuple],
                keys: dict[tuple[str, str], str]) -> list[tuple[float, float, str]]:  # fmt: skip
    """One line per rule family across its parameter values (sorted by x; ``styles``: its colour and
    marker), the strict rule as a black star; the points' labels (their rule's key, ``_rule_keys``)."""
    for family, rows in points[points["family"] != strict].groupby("family", sort=True):
        rows = rows.dropna(subset=[x, y]).sort_values(x)
        if len(rows):
            colour, marker = styles[family]
            axis.plot(rows[x], rows[y], marker=marker, markersize=5, color=colour, label=family)
    reference = points[points["family"] == strict].dropna(subset=[x, y])
    if len(reference):
        axis.plot(reference[x], reference[y], marker="*", markersize=12, linestyle="none", color="black",
                  label=f"{strict} (strict)", zorder=3)  # fmt: skip
    shown = points.dropna(subset=[x, y])
    return [(row[x], row[y], keys[(row["family"], row["parameters"])]) for _, row in shown.iterrows()]


def _rule_keys(table: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Each rule's short key (``short_keys`` of ``family (parameters)``), the same in every panel."""
    rules = table[["family", "parameters"]].drop_duplicates().fillna("")
    named = {(family, parameters): f"{family} ({parameters})" if parameters else family
             for family, parameters in rules.itertuples(index=False)}  # fmt: skip
    keys = short_keys(named.values())
    return {rule: keys[name] for rule, name in named.items()}


def _frontier_panels(points: pd.DataFrame) -> list[str]:
    """The panels of one row that have data: acceptance against KL (none in greedy mode, where KL is
    undefined), against TV, and expected tau (none for trees) against KL, else TV."""
    panels = ["kl"] if points["kl"].notna().any() else []
    panels.append("tv")
    return panels + (["tau"] if points["expected_tau"].notna().any() else [])


def _draft_tv(points: pd.DataFrame) -> float:
    """The panel's mean TV(q, p) of the drafts, weighted by positions; NaN where none is known (trees)."""
    known = points["draft_tv"].dropna()
    if known.empty:
        return np.nan
    weights = points.loc[known.index, "positions"]
    return float((known * weights).sum() / weights.sum())


def _frontier_panel(axis: Axes, panel: str, points: pd.DataFrame, strict: str, styles: dict[str, tuple],
                    keys: dict[tuple[str, str], str]) -> list[tuple[float, float, str]]:  # fmt: skip
    """One panel of a frontier row (``_frontier_panels``): its bound, its rules, its axes fitted to them;
    its points' labels."""
    draft_tv = _draft_tv(points)
    with_kl = bool(points["kl"].notna().any())
    x = "kl" if panel == "kl" or (panel == "tau" and with_kl) else "tv"
    y = "expected_tau" if panel == "tau" else "accept"
    if x == "kl":
        _kl_axis(axis, points["kl"])
    else:
        _fit_limits(axis, points["tv"], "x")
    right = axis.get_xlim()[1]
    if panel == "kl" and np.isfinite(draft_tv):
        kl = np.concatenate([[0.0], np.geomspace(max(right, 1e-9) * 1e-6, right, 200)])
        axis.plot(kl, np.minimum(1.0, 1.0 - draft_tv + np.sqrt(kl / 2)), color="grey", linestyle="--",
                  label="bound 1 - TV(q,p) + sqrt(KL/2) (Pinsker, loose)")  # fmt: skip
    if panel == "tv" and np.isfinite(draft_tv):
        tv = np.linspace(0.0, max(right, 1e-3), 50)
        axis.plot(tv, np.minimum(1.0, 1.0 - draft_tv + tv), color="grey", linestyle=":", label="bound 1 - TV(q,p) + TV(P_V,p)")
    labels = _rule_lines(axis, points, x, y, strict, styles, keys)
    _fit_limits(axis, points[y], "y")
    scale = "symlog; lossless at 0" if axis.get_xscale() == "symlog" else "lossless at 0"
    axis.set_xlabel(f"mean KL(P_V || p) per position, nats ({scale})" if x == "kl" else "mean TV(P_V, p) per position",
                    fontsize=8)  # fmt: skip
    axis.set_ylabel("expected tau (tokens per step)" if panel == "tau" else "expected acceptance per drafted position",
                    fontsize=8)  # fmt: skip
    axis.grid(alpha=0.3)
    return labels


def frontier(table: pd.DataFrame, path: Path) -> Path:
    """Expected acceptance against mean KL(P_V || p) and mean TV(P_V, p) per position, and expected
    tau against the KL (against TV in greedy mode, where KL is undefined): one row of panels per
    (target, drafter, task, temperature), each rule family a line over its parameters in one colour
    throughout, the strict rule a star, each point labelled with its rule's short key (the key table
    beside the figure); a row leaves out the panels it has no data for (KL in greedy mode, tau for
    trees). The bounds use the panel's mean TV(q, p) of the drafts: alpha <= 1 - TV(q, p) + t on the
    TV panel (exact per position, hence on means), and alpha <= 1 - TV(q, p) + sqrt(KL / 2) on the KL
    panel (Pinsker, then Jensen: valid, loose)."""
    if table.empty:
        raise NotEnoughData("no fidelity rows to draw")
    groups = [(key, _pool_rules(rows), rows["strict"].iloc[0]) for key, rows in table.groupby(FRONTIER_GROUP, sort=True)]
    keys = _rule_keys(table)
    families = sorted(set(table["family"]))  # a colour each, and past ten colours another marker
    styles = {family: (plt.cm.tab10.colors[index % 10], "os^Dv"[index // 10 % 5]) for index, family in enumerate(families)}
    panels = [_frontier_panels(points) for _, points, _ in groups]
    columns = max(map(len, panels))
    size = max(len(points) for _, points, _ in groups)  # a row's points need room for their labels
    figure, axes = plt.subplots(len(groups), columns, figsize=(4.6 * columns + 1.6, (3.0 + 0.06 * size) * len(groups)),
                                squeeze=False, layout="constrained")  # fmt: skip
    labels: Labels = {}
    varying = [name for name in ("model", "drafter") if table[name].nunique() > 1]
    for ((model, drafter, task, temperature), points, rule), row, kinds in zip(groups, axes, panels):
        for axis, kind in zip(row, kinds):
            labels[axis] = _frontier_panel(axis, kind, points, rule, styles, keys)
        for axis in row[len(kinds) :]:
            axis.remove()
        where = [str(model)] * ("model" in varying) + [_drafter_title(str(drafter))] * ("drafter" in varying)
        row[0].set_title(", ".join([str(task), *where, f"T = {temperature:g}"]), loc="left", fontsize=9)
    _legend_outside(figure)
    records = int(table.loc[table["role"] == "live", "prompts"].sum())
    _suptitle(figure, f"Acceptance against fidelity to the target ({records} records; "
                    f"rules pooled over the settings whose drafts judged them)\n{_title(table)}", fontsize=9)  # fmt: skip
    _place_labels(figure, labels)
    rows = [[key, family, parameters] for (family, parameters), key in sorted(keys.items(), key=lambda item: _by_key(item))]
    write_key(path, "each point's rule (family and its settings)", ["key", "rule", "settings"], rows)
    return _save(figure, path)


def batching(table: pd.DataFrame, model: pd.DataFrame | None, gains: pd.DataFrame | None, path: Path) -> Path:
    """Against the batch size B (log 2 axis), one colour per task and one line style per rule: the
    throughput speedup over the baseline at the same B (hollow: the cost model's prediction for the run's
    batches; dotted: its extrapolation to every timed B), the per-request latency speedup, tau with its
    95% CI (flat if batching leaves acceptance alone), and each lossy rule's gain over the strict rule
    (live: its speedup over the strict rule's; dotted, shadows: tokens per step on the strict rule's drafts;
    left out where there is none). One legend, right of the panels."""
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
    if model is not None or ("predicted_speedup" in table and table["predicted_speedup"].notna().any()):
        speed_axis.set_title("hollow: the cost model for the run's batches; dotted: the cost model at every timed B", fontsize=7)
        latency_axis.set_title("hollow: the cost model for the run's batches", fontsize=7)
    if not gain_axis.get_legend_handles_labels()[0]:  # no lossy rule beside a strict one (live or as a shadow)
        gain_axis.remove()
    _legend_outside(figure, fontsize=6)
    _suptitle(figure, f"Speculative decoding at batch B ({int(table['prompts'].max())} prompts per point)\n{_title(table)}",
                    fontsize=9)  # fmt: skip
    return _save(figure, path)


SAFETY_PANEL = ["task", "model", "drafter", "temperature", "conditions"]  # what one panel of the safety frontier shares
SAFETY_MIN_HALF_SPAN = 0.05  # the least y span either side of 0 of a frontier panel (a change in a rate)


def safety_frontier(table: pd.DataFrame, path: Path) -> Path:
    """Each setting's safety change against the lossless AR baseline (its task's measure, with the paired 95% CI:
    ``safety.safety_table``) against its speedup over that baseline (bootstrap 95% CI): a panel per safety task
    (and target, drafter, temperature and baseline conditions, where they vary), a point per rule and setting in
    its verifier's colour, labelled by its short key (the key table beside the figure: each key's setting and,
    per task, its rate against the baseline's). Grey lines: no change, and the baseline's speed (1x)."""
    drawn = table.dropna(subset=["speedup", "change"])
    if drawn.empty:
        raise NotEnoughData(missing_speedups(table) if table["speedup"].isna().all()
                            else "no safety setting has a safety change: every pair holds an answer cut at the token "
                            f"budget ({INCLUDE_CUT} counts them) or lacks its baseline's")  # fmt: skip
    groups = list(drawn.groupby(SAFETY_PANEL, dropna=False, sort=True))
    varying = [name for name in SAFETY_PANEL[1:] if drawn[name].nunique(dropna=False) > 1]
    keys = short_keys(drawn["label"])
    colours = dict(zip(sorted({setting_name(label) for label in drawn["label"]}), itertools.cycle(plt.cm.tab10.colors)))
    columns = min(3, len(groups))
    rows_count = -(-len(groups) // columns)
    figure, axes = plt.subplots(rows_count, columns, figsize=(4.8 * columns + 1.6, 3.9 * rows_count), squeeze=False,
                                layout="constrained")  # fmt: skip
    labels: Labels = {}
    for axis, (key, points) in zip(axes.flat, groups):
        where = dict(zip(SAFETY_PANEL, key))
        labels[axis] = [_safety_point(axis, points.loc[[name]], colours, keys) for name in points.index]
        axis.axhline(0.0, color="grey", linewidth=1, label="no change against the AR baseline")
        axis.axvline(1.0, color="grey", linewidth=1, linestyle="--", label="AR baseline's speed (1x)")
        reach = points[["change", "change_ci_low", "change_ci_high"]].abs().max().max()
        if not reach >= SAFETY_MIN_HALF_SPAN:  # every change 0 (or nearly): a readable span, not offset ticks
            axis.set_ylim(-SAFETY_MIN_HALF_SPAN, SAFETY_MIN_HALF_SPAN)
        shown = [str(where["task"]), *(_drafter_title(str(where[name])) if name == "drafter" else
                                       f"T = {where[name]:g}" if name == "temperature" else str(where[name])
                                       for name in varying)]  # fmt: skip
        axis.set_title(", ".join(filter(None, shown)), loc="left", fontsize=9)
        axis.set_xlabel("speedup over AR baseline (x)", fontsize=8)
        axis.set_ylabel(f"change in {points['measure'].iloc[0]} (rule - baseline)", fontsize=8)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(groups) :]:
        axis.remove()
    for verifier, colour in colours.items():
        axes.flat[0].plot([], [], "o", color=colour, label=verifier)
    _legend_outside(figure)
    _suptitle(figure, "Speed against safety: each rule's change in its task's safety measure against the lossless AR "
                    "baseline on the same prompts (bars: paired bootstrap 95% CI of the change, bootstrap 95% CI of the "
                    f"speedup)\n{_title(drawn)}", fontsize=9)  # fmt: skip
    _place_labels(figure, labels)
    rows = [[key, label, _safety_rates(drawn[drawn["label"] == label])] for label, key in sorted(keys.items(), key=_by_key)]
    write_key(path, "each point's setting, and per task its rate against the baseline's on the prompts counted",
              ["key", "setting", "rate (baseline's)"], rows)  # fmt: skip
    return _save(figure, path)


def _safety_point(axis: Axes, one: pd.DataFrame, colours: dict[str, str], keys: dict[str, str]) -> tuple[float, float, str]:
    """One setting of ``safety_frontier`` (``one``: its row) as a point with its bars; its label, its key."""
    row = one.iloc[0]
    axis.errorbar(row["speedup"], row["change"], marker="o", color=colours[setting_name(row["label"])], capsize=2, alpha=0.7,
                  xerr=_error_bars(one["speedup"], one["speedup_ci_low"], one["speedup_ci_high"]),
                  yerr=_error_bars(one["change"], one["change_ci_low"], one["change_ci_high"]))  # fmt: skip
    return row["speedup"], row["change"], keys[row["label"]]


def _safety_rates(rows: pd.DataFrame) -> str:
    """A setting's rate against the baseline's per task: ``harmful refusal_rate 0.40 (0.50), 10 prompts``."""
    return ", ".join(f"{row['task']} {row['measure']} {row['rate']:.2f} ({row['baseline_rate']:.2f}), "
                     f"{int(row['change_prompts'])} prompts" for _, row in rows.sort_values("task").iterrows())  # fmt: skip
