"""Every figure of the committed examples (analysis/examples/*), drawn from their records as the analysis draws
them, can be read: each panel drawn holds data, no text lies over another (point labels, tick labels,
axis labels, titles, legends; matplotlib gives each text's window extent) and no legend over a panel."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import Collection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from mars_bench.analysis import figures  # noqa: E402
from mars_bench.analysis.__main__ import read_parquet, write_all  # noqa: E402
from mars_bench.analysis.batching import find_costs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(path.parent for path in (REPO / "analysis" / "examples").glob("*/records.parquet"))
TOLERANCE_PX = 2.0  # texts may touch by this much (antialiased edges, a descender's padding)

pytestmark = pytest.mark.slow


@pytest.fixture
def drawn(monkeypatch) -> list[tuple[str, Figure]]:
    """The figures the analysis draws in this test, by file name, kept open to be inspected."""
    kept: list[tuple[str, Figure]] = []

    def keep(figure: Figure, path: Path) -> Path:
        kept.append((path.name, figure))
        return path

    monkeypatch.setattr(figures, "_save", keep)
    yield kept
    for _, figure in kept:
        plt.close(figure)


def has_data(axis: Axes) -> bool:
    """Whether ``axis`` draws data: a line in data coordinates with a finite point (not a reference line
    across the panel, whose x or y is in axes coordinates), a collection with paths (bars, scatters), a
    histogram's or bar's patch."""
    for line in axis.lines:
        if isinstance(line, Line2D) and line.get_transform() is axis.transData:
            x, y = (np.asarray(values, dtype=float) for values in line.get_data())
            if (np.isfinite(x) & np.isfinite(y)).any():
                return True
    if any(isinstance(collection, Collection) and len(collection.get_paths()) for collection in axis.collections):
        return True
    return any(not isinstance(patch, Rectangle) or patch.get_height() for patch in axis.patches) or bool(axis.images)


def drawn_tick_labels(axis: Axes) -> list[Text]:
    """The tick labels ``axis`` draws: visible, with text, at ticks inside its view."""
    labels = []
    for scale in (axis.xaxis, axis.yaxis):
        low, high = sorted(scale.get_view_interval())
        slack = 1e-9 * max(abs(low), abs(high), 1.0)
        for locations, ticks in ((scale.get_majorticklocs(), scale.get_major_ticks),
                                 (scale.get_minorticklocs(), scale.get_minor_ticks)):  # fmt: skip
            for location, tick in zip(locations, ticks(len(locations))):
                if low - slack <= location <= high + slack:
                    labels += [label for label in (tick.label1, tick.label2) if label.get_visible() and label.get_text()]
    return labels


def drawn_texts(figure: Figure) -> list[Text]:
    """Every text ``figure`` draws: its own and its legends', its panels' titles, axis labels, tick labels
    (``drawn_tick_labels``), annotations and legends."""
    every_tick_label = {id(label) for axis in figure.axes for scale in (axis.xaxis, axis.yaxis)
                        for tick in [*scale.get_major_ticks(), *scale.get_minor_ticks()]
                        for label in (tick.label1, tick.label2)}  # fmt: skip
    texts = [text for text in figure.findobj(Text) if id(text) not in every_tick_label]
    texts += [label for axis in figure.axes for label in drawn_tick_labels(axis)]
    return [text for text in texts if shown(text)]


def shown(text: Text) -> bool:
    """Whether ``text`` is drawn: visible, with text, in a visible panel (an annotation: its point inside it)."""
    if not (text.get_visible() and text.get_text().strip()) or (text.axes is not None and not text.axes.get_visible()):
        return False
    return not hasattr(text, "xy") or text.axes is None or text.axes.contains_point(text.axes.transData.transform(text.xy))


def overlaps(figure: Figure) -> list[str]:
    """Each pair of drawn texts whose window extents overlap by more than ``TOLERANCE_PX`` both ways."""
    renderer = figure.canvas.get_renderer()
    texts = drawn_texts(figure)
    boxes = np.array([Text.get_window_extent(text, renderer).extents for text in texts]).reshape(-1, 4)  # an annotation's
    # own extent takes in its leader line: the text's alone here (the figures keep leaders off labels themselves)
    across = np.minimum(boxes[:, None, 2], boxes[None, :, 2]) - np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    up = np.minimum(boxes[:, None, 3], boxes[None, :, 3]) - np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    first, second = np.nonzero(np.triu((across > TOLERANCE_PX) & (up > TOLERANCE_PX), k=1))
    return [f"{texts[i].get_text()!r} over {texts[j].get_text()!r}" for i, j in zip(first, second)]


def legends_over_panels(figure: Figure) -> list[str]:
    """Each legend that lies over a drawn panel (and so over its data) by more than ``TOLERANCE_PX``."""
    renderer = figure.canvas.get_renderer()
    legends = [*figure.legends, *(axis.get_legend() for axis in figure.axes if axis.get_legend() is not None)]
    found = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for axis in figure.axes:
            panel = axis.get_window_extent(renderer)
            across = min(box.x1, panel.x1) - max(box.x0, panel.x0)
            up = min(box.y1, panel.y1) - max(box.y0, panel.y0)
            if axis.get_visible() and across > TOLERANCE_PX and up > TOLERANCE_PX:
                first = legend.get_texts()[0].get_text()
                found.append(f"legend {first!r}... over panel {axis.get_title() or axis.get_ylabel()!r}")
    return found


def empty_panels(figure: Figure) -> list[str]:
    """The drawn panels of ``figure`` without data, by title and y label."""
    return [f"{axis.get_title(loc='left') or axis.get_title()!r} ({axis.get_ylabel()!r})"
            for axis in figure.axes if axis.get_visible() and axis.axison and not has_data(axis)]  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLES, ids=[folder.name for folder in EXAMPLES])
def test_every_figure_of_an_example_has_data_in_each_panel_and_no_text_or_legend_over_another(example, tmp_path, drawn):
    write_all(read_parquet(example / "records.parquet"), tmp_path, costs=find_costs([example]))
    assert drawn, f"{example.name}: no figure drawn"
    problems = []
    for name, figure in drawn:
        figure.draw_without_rendering()
        problems += [f"{name}: empty panel {panel}" for panel in empty_panels(figure)]
        problems += [f"{name}: {pair}" for pair in overlaps(figure)]
        problems += [f"{name}: {legend}" for legend in legends_over_panels(figure)]
    assert not problems, f"{example.name}: {len(problems)} problems:\n" + "\n".join(problems[:40])


def test_the_check_sees_text_over_text_an_empty_panel_and_a_legend_over_a_panel():
    figure, (full, empty) = plt.subplots(1, 2, layout="constrained")
    full.plot([0, 1], [0, 1])
    full.annotate("a label", (0.5, 0.5))
    full.annotate("another label", (0.5, 0.5))
    empty.axhline(1.0, label="reference")  # a reference line is no data
    empty.legend()
    figure.draw_without_rendering()
    try:
        assert overlaps(figure) == ["'a label' over 'another label'"]
        assert empty_panels(figure) == ["'' ('')"]
        assert legends_over_panels(figure) == ["legend 'reference'... over panel ''"]
    finally:
        plt.close(figure)


def test_short_keys_name_the_verifier_and_tell_its_settings_apart():
    keys = figures.short_keys(["rejection, confidence length", "mars (theta=0.84)", "mars (theta=0.9)",
                               "fly (entropy=0.3, window=6)", "fly (entropy=0.1, window=6)"])  # fmt: skip
    assert keys == {"rejection, confidence length": "rejection", "mars (theta=0.84)": "mars 0.84",
                    "mars (theta=0.9)": "mars 0.9", "fly (entropy=0.1, window=6)": "fly 1",
                    "fly (entropy=0.3, window=6)": "fly 2"}  # fmt: skip


def test_the_safety_frontier_has_data_in_each_panel_and_no_text_or_legend_over_another(tmp_path, drawn):
    """No committed example has safety records: a sweep of the four safety tasks' shape, with points on one another
    (the lossless rules at no change), drawn as the analysis draws it."""
    rules = {"exact": (1.9, 0.0), "mars (theta=0.5)": (2.4, -0.3), "mars (theta=0.7)": (2.3, -0.2),
             "mars (theta=0.9)": (2.1, 0.0), "mars_ref": (2.35, -0.25), "typical": (2.2, -0.1),
             "fly (entropy=0.3, window=6)": (2.25, -0.05), "fly (entropy=0.1, window=6)": (2.15, 0.0)}  # fmt: skip
    measures = {"harmful": "refusal_rate", "jailbreak": "attack_success", "injection": "injection_success",
                "over_refusal": "over_refusal"}  # fmt: skip
    rows = []
    for sign, (task, measure) in zip((1, -1, -1, -1), measures.items()):
        for label, (speedup, change) in rules.items():
            rows.append({"task": task, "model": "smollm2-135m", "drafter": "layerskip", "temperature": 0.0, "conditions": "",
                         "label": label, "measure": measure, "speedup": speedup, "speedup_ci_low": speedup - 0.1,
                         "speedup_ci_high": speedup + 0.1, "change": sign * change, "change_ci_low": sign * change - 0.2,
                         "change_ci_high": sign * change + 0.2, "rate": 0.5, "baseline_rate": 0.5 - sign * change,
                         "change_prompts": 10})  # fmt: skip
    figures.safety_frontier(pd.DataFrame(rows), tmp_path / "safety_frontier.png")
    ((name, figure),) = drawn
    figure.draw_without_rendering()
    problems = [f"empty panel {panel}" for panel in empty_panels(figure)] + overlaps(figure) + legends_over_panels(figure)
    assert not problems, "\n".join(problems)
    assert len(figure.axes) == 4 and (tmp_path / "safety_frontier_key.md").is_file()
