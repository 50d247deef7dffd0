"""Batching: what each rule's speedup is worth at batch B, measured and as the cost model predicts.

A run at ``batch_size`` B records, per row, the drafts of each step (``step_drafted``) and what the
step accepted. The rows of one batch step in lockstep: a step of the batch's active rows (those that
have not finished) drafts until its deepest row stops, then runs one target forward over every row's
root and drafts. With the forward costs of ``python -m mars_bench.perf.batch_costs`` (seconds of a
batched forward of B rows x width tokens, timed in isolation) the model gives each batch's time:

- a speculative step of a batch with ``b`` active rows whose deepest draft is ``d``: the drafter's feed
  forward (``b`` rows x 2 tokens where a row accepted all its drafts, else 1), ``d - 1`` drafter forwards
  of one token per row, and one target forward of ``b`` rows x ``d + 1`` tokens;
- an autoregressive step: one target forward of ``b`` rows x 1 token.

Everything else (verification, sampling, cache bookkeeping) is left out, so a measured speedup below
the prediction shows what that costs. Those forward costs are this package's engine's, so they price only
rows whose records say that engine decoded them (``own_engine``); rows of another engine are priced by
its own step times where their records carry them (``engine_step_costs``: vLLM's whole steps, drafting
and verification inside), and not at all where not. Predicted and measured speedups are throughput
ratios: all rows' new tokens over the batches' time, method against its baseline at the same B; the
prefill of both sides is taken as measured. The same model, fed the recorded steps of every row of a
task and rule (acceptance does not depend on B) in batches of each timed B, extrapolates the speedup to
batch sizes not run and gives the batch size where speculative decoding stops paying.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mars_bench.bench.records import BASELINE
from mars_bench.bench.stats import percentile_ci
from mars_bench.bench.summary import finished
from mars_bench.common.strict_rule import strict_verifier

from .acceptance import shadow_labels, share_of_sums
from .cells import NotEnoughData, method_rows, recorded_setting, varying_labels

COSTS_FILE = "batch_costs.json"  # written by python -m mars_bench.perf.batch_costs RUN
ENGINE_STEPS = "the engine's own steps (engine_step_s)"  # BatchCosts.source of costs read from a backend's steps
KEYS = ["model", "task", "temperature", "label"]
RULE_KEYS = ["model", "task", "temperature", "rule"]  # the same, as the tables name the column


def _grid_interpolate(table: dict[str, dict[str, float]], rows: float, width: float) -> float:
    """Bilinear interpolation of {B: {width: seconds}} at (rows, width); linear extrapolation past the last width."""
    sizes = sorted(int(size) for size in table)
    widths = sorted(int(w) for w in table[str(sizes[0])])

    def along_width(size: int) -> float:
        values = [table[str(size)][str(w)] for w in widths]
        if width > widths[-1]:  # past the deepest width timed: the last segment's slope
            slope = (values[-1] - values[-2]) / (widths[-1] - widths[-2])
            return values[-1] + slope * (width - widths[-1])
        return float(np.interp(width, widths, values))

    if rows >= sizes[-1] or len(sizes) == 1:
        return along_width(sizes[-1]) * (rows / sizes[-1] if rows > sizes[-1] else 1.0)
    return float(np.interp(rows, sizes, [along_width(size) for size in sizes]))


@dataclass(frozen=True)
class BatchCosts:
    """Isolated forward costs at batch B (``perf/batch_costs.py``): seconds per (rows, width)."""

    target: dict[str, dict[str, float]]
    drafter: dict[str, dict[str, float]]
    source: str = ""

    @classmethod
    def load(cls, path: Path) -> BatchCosts:
        data = json.loads(path.read_text())
        return cls(data["target_s"], data["drafter_s"], str(path))

    @property
    def from_engine_steps(self) -> bool:
        """Read from a serving engine's own steps (``engine_step_costs``), not timed forwards of this package's."""
        return self.source == ENGINE_STEPS

    @property
    def label(self) -> str:
        """What the costs came from, as the tables' ``costs`` column names it."""
        return ENGINE_STEPS if self.from_engine_steps else COSTS_FILE

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(int(size) for size in self.target)

    def target_s(self, rows: int, width: int) -> float:
        return _grid_interpolate(self.target, rows, width)

    def drafter_s(self, rows: int, width: int) -> float:
        return _grid_interpolate(self.drafter, rows, width)


def engine_step_costs(frame: pd.DataFrame) -> dict[tuple[str, str], BatchCosts]:
    """Per (model, backend) whose rows carry a serving engine's own timed steps (``engine_step_s``, with the
    requests each served, ``engine_step_rows``): the cost model's step seconds read from them, as a table of
    (requests served, tokens each request fed: its drafts + 1, 1 autoregressive) -> the median step. A step's
    drafting is inside its time, so the drafter's table is zero. Sizes a width was not seen at are
    interpolated along the sizes it was seen at (flat past either end); a (model, backend) seen at one width
    only is left out (nothing to tell a draft's price from)."""
    seen: dict[tuple[str, str], dict[tuple[int, int], list[float]]] = {}
    for row in frame.itertuples():
        seconds, served = list(row.engine_step_s), list(row.engine_step_rows)
        if not seconds:
            continue
        drafted = list(row.step_drafted)
        widths = [d + 1 for d in drafted] if len(drafted) == len(seconds) else [1] * len(seconds) if not drafted else []
        for size, width, step_s in zip(served, widths, seconds):
            seen.setdefault((row.model, row.backend), {}).setdefault((int(size), int(width)), []).append(float(step_s))
    costs = {}
    for key, steps in seen.items():
        widths = sorted({width for _, width in steps})
        if len(widths) < 2:
            continue
        sizes = sorted({size for size, _ in steps})
        table: dict[str, dict[str, float]] = {str(size): {} for size in sizes}
        for width in widths:
            at = sorted((size, float(np.median(values))) for (size, w), values in steps.items() if w == width)
            for size in sizes:
                table[str(size)][str(width)] = float(np.interp(size, [s for s, _ in at], [v for _, v in at]))
        zero = {size: dict.fromkeys(row, 0.0) for size, row in table.items()}
        costs[key] = BatchCosts(table, zero, ENGINE_STEPS)
    return costs


def costs_of(rows: pd.DataFrame, costs: BatchCosts | None, engine: dict[tuple[str, str], BatchCosts]) -> BatchCosts | None:
    """What prices ``rows`` (one model's, run by one backend): their engine's own steps where recorded, else
    ``costs`` (``batch_costs.json``, timed in this package's engine) where that engine decoded them (their
    ``own_engine``), else none."""
    first = rows.iloc[0]
    return engine.get((first["model"], first["backend"]), costs if first["own_engine"] else None)


def find_costs(folders: list[str | Path]) -> BatchCosts | None:
    """The first ``batch_costs.json`` in (or below) the analysed folders; None where there is none."""
    for folder in folders:
        for path in [Path(folder) / COSTS_FILE, *sorted(Path(folder).rglob(COSTS_FILE))]:
            if path.is_file():
                return BatchCosts.load(path)
    return None


def modelled_step_seconds(rows: list[tuple[list[int], list[int]]], costs: BatchCosts) -> list[tuple[float, float]]:
    """(target seconds, drafter seconds) the cost model gives each step of a batch: ``rows`` holds each
    row's (drafts per step, accepted per step); rows step in lockstep and leave the batch after their last step."""
    seconds, all_accepted = [], [True] * len(rows)  # the first feed holds the prompt's last token and the first token
    for step in range(max((len(drafted) for drafted, _ in rows), default=0)):
        active = [index for index, (drafted, _) in enumerate(rows) if len(drafted) > step]
        depth = max(rows[index][0][step] for index in active)
        drafting = 0.0
        if depth > 0:
            feed = 2 if any(all_accepted[index] for index in active) else 1
            drafting = costs.drafter_s(len(active), feed) + (depth - 1) * costs.drafter_s(len(active), 1)
        seconds.append((costs.target_s(len(active), depth + 1), drafting))
        for index in active:
            drafted, accepted = rows[index][0][step], rows[index][1][step]
            all_accepted[index] = accepted == drafted  # its last draft was never fed: the next feed is 2 tokens
    return seconds


def modelled_steps_s(rows: list[tuple[list[int], list[int]]], costs: BatchCosts) -> float:
    """The modelled seconds of a batch's steps (``modelled_step_seconds``), summed."""
    return sum(target + drafting for target, drafting in modelled_step_seconds(rows, costs))


def modelled_finish_s(rows: list[tuple[list[int], list[int]]], costs: BatchCosts) -> list[float]:
    """Each row's modelled seconds from the end of the prefill to its last step (its latency less the prefill)."""
    return finishes(rows, modelled_step_seconds(rows, costs))


def finishes(rows: list[tuple[list[int], list[int]]], seconds: list[tuple[float, float]]) -> list[float]:
    """Each row's seconds to its last step, given the batch's steps' (target, drafter) ``seconds``."""
    elapsed = np.cumsum([0.0, *(target + drafting for target, drafting in seconds)])
    return [float(elapsed[len(drafted)]) for drafted, _ in rows]


def ar_steps(new_tokens: int) -> tuple[list[int], list[int]]:
    """An autoregressive row's steps: every token after the prefill's, one step each, no drafts."""
    count = max(int(new_tokens) - 1, 0)
    return [0] * count, [0] * count


def row_steps(row: pd.Series) -> tuple[list[int], list[int]]:
    drafted = list(row["step_drafted"]) if isinstance(row["step_drafted"], list | np.ndarray) else []
    if not drafted and row["method"] == BASELINE:
        return ar_steps(row["new_tokens"])
    return drafted, list(row["step_accepted"])


def batches_of(rows: pd.DataFrame) -> list[pd.DataFrame]:
    """The rows of each batch a cell decoded (a run folder's rows of one method and batch id)."""
    return [group for _, group in rows.groupby(["run_dir", "cell", "method", "batch_id"], sort=True)]


@dataclass(frozen=True)
class Modelled:
    """What the cost model gives the batches of some rows: seconds in all (each batch's measured prefill
    and its modelled steps), of the steps alone and of their target forwards alone, and the mean
    per-request latency (a row's batch's prefill and its modelled steps up to its last)."""

    seconds: float
    steps_s: float
    target_s: float
    latency_s: float


def modelled(rows: pd.DataFrame, costs: BatchCosts) -> Modelled:
    """The cost model over every batch of ``rows``, one pass over each batch's steps."""
    prefills = steps_s = target_s = 0.0
    latencies = []
    for batch in batches_of(rows):
        steps = [row_steps(row) for _, row in batch.iterrows()]
        seconds = modelled_step_seconds(steps, costs)
        prefill = float(batch["prefill_s"].max())
        prefills, target_s = prefills + prefill, target_s + sum(target for target, _ in seconds)
        steps_s += sum(target + drafting for target, drafting in seconds)
        latencies += [prefill + finish for finish in finishes(steps, seconds)]
    return Modelled(prefills + steps_s, steps_s, target_s, float(np.mean(latencies)))


def in_run_target_s(rows: pd.DataFrame) -> float:
    """The target forwards' seconds the decodes themselves measured (``step_target_s``), each batch's step
    counted once (every row of a batch records the batch's step)."""
    total = 0.0
    for batch in batches_of(rows):
        steps = [list(seconds) for seconds in batch["step_target_s"]]
        total += sum(max(row[step] for row in steps if len(row) > step) for step in range(max(map(len, steps), default=0)))
    return total


def batch_seconds(rows: pd.DataFrame) -> float:
    """The measured wall time of every batch of ``rows`` (each batch counted once)."""
    return float(sum(batch["batch_s"].max() for batch in batches_of(rows)))


def batching_table(frame: pd.DataFrame, costs: BatchCosts | None, include_disturbed: bool = False) -> pd.DataFrame:
    """Per task, rule and batch size: the measured throughput and latency speedups over the baseline at the same
    B, the modelled speedup and measured / modelled (``costs_of``: with ``costs`` for this package's engine,
    with a serving engine's own step times for its rows; ``costs`` names which), tau, the in-run target
    forward seconds over the modelled ones (this package's engine), the peak memory of the method's and the
    baseline's batches, and the speedup over the strict rule's at the same task and B (``gain_over_strict``).
    A batch is timed as one decode, so its rows are disturbed together: the speedups leave out the prompts of
    a disturbed batch, on both sides (the same chunks of prompts), unless ``include_disturbed``; ``disturbed``
    counts them."""
    ok = finished(frame)
    if "batch_id" not in ok or "step_drafted" not in ok:
        raise NotEnoughData("no row carries its batch and steps (records of schema 9 on)")
    methods = rule_rows(frame)
    if methods["batch_size"].nunique() < 2:
        raise NotEnoughData("the rows were decoded at one batch size (run experiment=batching, or batch_size=1,2,4,8)")
    bases = ok[ok["method"] == BASELINE].drop_duplicates(["run_dir", "question_id", "turn", "batch_size", "cell"])
    engine = engine_step_costs(ok)
    out = []
    for (model, task, temperature, label, size), rows in methods.groupby([*KEYS, "batch_size"], sort=True):
        prompts = rows[["question_id", "turn"]].drop_duplicates()
        base = bases[(bases["model"] == model) & (bases["task"] == task) & (bases["temperature"] == temperature)
                     & (bases["batch_size"] == size) & bases["run_dir"].isin(rows["run_dir"])
                     & bases["cell"].isin(rows["cell"])].merge(prompts)  # fmt: skip
        if base.empty:
            continue
        disturbed = pd.concat([rows[rows["disturbed"]], base[base["disturbed"]]])[["question_id", "turn"]].drop_duplicates()
        if not include_disturbed and len(disturbed):
            kept = prompts.merge(disturbed, how="left", indicator=True)["_merge"].eq("left_only").to_numpy()
            prompts = prompts[kept]
            rows, base = rows.merge(prompts), base.merge(prompts)
            if rows.empty:
                continue
        tokens, base_tokens = rows["new_tokens"].sum(), base["new_tokens"].sum()
        measured = (tokens / batch_seconds(rows)) / (base_tokens / batch_seconds(base))
        entry = {"model": model, "drafter": rows["drafter"].iloc[0], "task": task, "temperature": temperature, "rule": label,
                 "batch_size": int(size),
                 "prompts": len(rows), "disturbed": len(disturbed),
                 "speedup": measured,
                 "latency_speedup": base["latency_s"].mean() / rows["latency_s"].mean(),
                 "tau": rows["emitted"].sum() / rows["steps"].sum(),
                 **dict(zip(("tau_ci_low", "tau_ci_high"), tau_ci(rows))),
                 "peak_memory_mb": rows["peak_memory_mb"].max() if "peak_memory_mb" in rows else np.nan,
                 "peak_memory_base_mb": base["peak_memory_mb"].max() if "peak_memory_mb" in base else np.nan}  # fmt: skip
        priced = costs_of(rows, costs, engine)
        if priced is not None:
            mine, theirs = modelled(rows, priced), modelled(base, priced)
            predicted = (tokens / mine.seconds) / (base_tokens / theirs.seconds)
            own = not priced.from_engine_steps  # a serving engine's steps hold no forward of their own to compare
            entry |= {"predicted_speedup": predicted, "measured_over_predicted": measured / predicted,
                      "predicted_latency_speedup": theirs.latency_s / mine.latency_s,
                      "target_in_run_over_model": in_run_target_s(rows) / mine.target_s if own and mine.target_s else np.nan,
                      "modelled_step_s": mine.steps_s, "costs": priced.label}  # fmt: skip
        out.append(entry)
    table = pd.DataFrame(out)
    if table.empty:
        raise NotEnoughData("no method rows have a baseline decoded at the same batch size in the same cell")
    strict = table[table["rule"] == table["temperature"].map(strict_verifier)]
    reference = strict.set_index(["model", "task", "temperature", "batch_size"])["speedup"]
    keys = list(zip(table["model"], table["task"], table["temperature"], table["batch_size"]))
    table["gain_over_strict"] = [s / reference.get(k, np.nan) for s, k in zip(table["speedup"], keys)]
    return table


def tau_ci(rows: pd.DataFrame) -> tuple[float, float]:
    """The percentile bootstrap 95% CI of pooled tau, resampling requests (whether tau stays flat in B is read against it)."""
    return percentile_ci((rows["emitted"].to_numpy(float), rows["steps"].to_numpy(float)), share_of_sums, 2000, 0.95, 0)


def rule_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """``method_rows``, each labelled with its rule: the verifier, with the settings that differ between its
    cells (``cells.varying_labels``), without the baseline conditions (the batch size among them)."""
    methods = method_rows(frame)
    settings = [recorded_setting(setting) for setting in methods["verifier_setting"]]
    return methods.assign(label=varying_labels(methods["verifier"], settings))


def extrapolated(frame: pd.DataFrame, costs: BatchCosts | None, seed: int = 0) -> pd.DataFrame:
    """Per task and rule, the modelled throughput speedup at every batch size the costs were timed at: the
    recorded rows of every B, shuffled once, in batches of B (acceptance does not depend on B), against
    their baselines' rows in the same batches; and ``crossover``, the smallest such B whose modelled
    speedup is below 1 (NaN where none is). A batch's prefill is its rows' shares of their own batches'
    measured prefills (a prefill is compute-bound: its time grows with the batch's prompt tokens). Rows are
    priced as in ``batching_table`` (``costs_of``), at the batch sizes their costs hold."""
    ok = finished(frame)
    methods = rule_rows(frame)
    bases = ok[ok["method"] == BASELINE]
    engine = engine_step_costs(ok)
    out = []
    for (model, task, temperature, label), rows in methods.groupby(KEYS, sort=True):
        priced = costs_of(rows, costs, engine)
        if priced is None:
            continue
        columns = ["run_dir", "cell", "question_id", "turn", "batch_size", "new_tokens", "prefill_s", "batch_rows"]
        paired = rows.merge(bases[columns], on=columns[:5], suffixes=("", "_base"))
        if paired.empty:
            continue
        order = list(range(len(paired)))
        random.Random(seed).shuffle(order)
        for size in priced.batch_sizes:
            batches = [order[start : start + size] for start in range(0, len(order) - size + 1, size)]
            if not batches:
                continue
            spec = base = 0.0
            for batch in batches:
                picked = paired.iloc[batch]
                spec += modelled_steps_s([row_steps(row) for _, row in picked.iterrows()], priced)
                base += modelled_steps_s([ar_steps(n) for n in picked["new_tokens_base"]], priced)
                spec += float((picked["prefill_s"] / picked["batch_rows"]).sum())
                base += float((picked["prefill_s_base"] / picked["batch_rows_base"]).sum())
            used = paired.iloc[[index for batch in batches for index in batch]]
            speedup = (used["new_tokens"].sum() / spec) / (used["new_tokens_base"].sum() / base)
            out.append({"model": model, "task": task, "temperature": temperature, "rule": label, "batch_size": size,
                        "batches": len(batches), "modelled_speedup": speedup,
                        "costs": priced.label})  # fmt: skip
    table = pd.DataFrame(out)
    if table.empty:
        raise NotEnoughData("no method rows pair with a baseline row and have costs (batch_costs.json, or their engine's "
                            "own steps)")
    below = table[table["modelled_speedup"] < 1].groupby(RULE_KEYS)["batch_size"].min().rename("crossover")
    return table.merge(below.astype(float), on=RULE_KEYS, how="left")


def shadow_gains(frame: pd.DataFrame) -> pd.DataFrame:
    """Per task, live rule, batch size and shadow: tokens per step the shadow would have emitted on the
    live rule's very drafts (its kept drafts + 1, per drafting step) over what the live rule emitted."""
    methods = method_rows(frame)
    if "shadow_accepted" not in methods or not methods["shadow_accepted"].map(lambda s: isinstance(s, dict) and bool(s)).any():
        raise NotEnoughData("no method row carries shadow verifiers")
    labels = shadow_labels(sorted({n for s in methods["shadow_accepted"] if isinstance(s, dict) for n in s}))
    out = []
    for (model, task, temperature, verifier, size), rows in methods.groupby(
        ["model", "task", "temperature", "verifier", "batch_size"], sort=True
    ):
        live_kept = sum(sum(steps) for steps in rows["step_accepted"])
        steps = sum(len(steps) for steps in rows["step_accepted"])
        for name, label in labels.items():
            kept = sum(sum(s.get(name, [])) for s in rows["shadow_accepted"] if isinstance(s, dict))
            if not kept:
                continue
            out.append({"model": model, "task": task, "temperature": temperature, "live": verifier, "batch_size": int(size),
                        "shadow": label, "tau_gain": (kept + steps) / (live_kept + steps) if steps else np.nan})  # fmt: skip
    return pd.DataFrame(out)
