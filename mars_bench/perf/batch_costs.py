"""``python -m mars_bench.perf.batch_costs RUN [--out FILE]``: the forward costs of a run's target and
drafter at batch B, timed in isolation, for the cost model at batch B (``analysis/batching.py``).

A batched speculative step costs one drafter forward that feeds each row's new tokens, one drafter
forward of one token per row for each further draft position, and one target forward over the rows'
root and drafts (B x (k + 1) slots); an autoregressive step costs a target forward of one token per
row. This times each of them as the batched engine runs it (``kvcache.batch_forward``: a 4D mask,
every slot's logits), on the models and drafter settings of RUN's first cell (its ``config.yaml``:
the same weights, precision, quantization and draft vocabulary), after ``--context`` cached
positions per row, median of ``--repeats`` after one warm-up. Writes a JSON of seconds per (B, width).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from mars_bench.bench.manifest import cpu_description
from mars_bench.common.files import atomic_replace
from mars_bench.models.kvcache import batch_forward, crop_batch, new_cache
from mars_bench.models.placement import input_device
from mars_bench.perf.costs import synced_time

BATCH_SIZES = (1, 2, 4, 8, 16)
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 17)  # tokens per row in one forward: a root and up to 16 drafts
CONTEXT = 256  # cached positions per row: a HumanEval prompt (about 150 tokens) and half its answer


@torch.inference_mode()
def batch_forward_seconds(
    model: Any, rows: int, widths: tuple[int, ...], context: int = CONTEXT, repeats: int = 3
) -> dict[int, float]:
    """Per width: the median seconds of one batched forward of ``width`` new tokens in each of ``rows``
    rows, after ``context`` cached positions per row (logits for every slot, as the engine asks)."""
    device = input_device(model)
    draw = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().weight.shape[0]
    cache = new_cache(model)
    prompt = torch.randint(0, vocab, (rows, context), generator=draw).to(device)
    no_cache = torch.zeros(rows, 0, dtype=torch.bool, device=device)
    _, attended = batch_forward(model, cache, no_cache, prompt, torch.ones_like(prompt, dtype=torch.bool), 1)
    seconds = {}
    for width in widths:
        new = torch.randint(0, vocab, (rows, width), generator=draw).to(device)
        fed = torch.ones_like(new, dtype=torch.bool)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = synced_time(device)
            batch_forward(model, cache, attended, new, fed)
            times.append(synced_time(device) - start)
            crop_batch(cache, attended, context)
        seconds[width] = statistics.median(times[1:])
    return seconds


def cost_table(model: Any, batch_sizes: tuple[int, ...], widths: tuple[int, ...], context: int, repeats: int,
               on_each: Any = None) -> dict[str, dict[str, float]]:  # fmt: skip
    """{str(B): {str(width): seconds}} for every B and width (one prefill per B)."""
    table: dict[str, dict[str, float]] = {}
    for rows in batch_sizes:
        for width, seconds in batch_forward_seconds(model, rows, widths, context, repeats).items():
            table.setdefault(str(rows), {})[str(width)] = seconds
            if on_each is not None:
                on_each(rows, width, seconds)
    return table


def run_config(run: Path) -> tuple[Path, Any]:
    """The first cell config below ``run`` (a run or sweep folder) whose drafter drafts with a model."""
    from mars_bench.drafting import drafter_needs_model

    configs = sorted(run.glob("config.yaml")) + sorted(run.glob("*/config.yaml"))
    for path in configs:
        cfg = OmegaConf.load(path)
        if drafter_needs_model(cfg.drafter.name):
            return path, cfg
    raise ValueError(f"{run}: no config.yaml of a cell whose drafter is a model (model or layerskip) below it")


def measure(run: Path, batch_sizes: tuple[int, ...], widths: tuple[int, ...], context: int, repeats: int) -> dict[str, Any]:
    """The target's and the drafter's forward costs for ``run``'s configuration."""
    from mars_bench.backends.hf import load_models
    from mars_bench.config.method import method_spec

    path, cfg = run_config(run)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    models = load_models(cfg)
    target = models["target"]
    draft_model = models["drafter"].model if "drafter" in models else None
    drafter = method_spec(cfg).build_drafter(target.model, draft_model, tokenizer=target.tokenizer)

    def say(rows: int, width: int, seconds: float) -> None:
        print(f"batch_costs: B={rows} width={width}: {seconds * 1000:.1f} ms", file=sys.stderr, flush=True)

    return {
        "config": str(path),
        "target": cfg.model.target,
        "draft_model": cfg.model.draft_model,
        "dtype": cfg.model.dtype,
        "drafter_setting": {key: cfg.drafter[key] for key in ("name", "draft_vocab", "weights", "layers") if key in cfg.drafter},
        "threads": torch.get_num_threads(),
        "cpu": cpu_description(),
        "context": context,
        "repeats": repeats,
        "target_s": cost_table(target.model, batch_sizes, widths, context, repeats, say),
        "drafter_s": cost_table(drafter.model, batch_sizes, widths, context, repeats, say),
    }


def parse_sizes(text: list[str], option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(value) for value in text)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{option} {' '.join(text)} is invalid: allowed are integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mars_bench.perf.batch_costs", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run or sweep folder (its first cell's config.yaml names the models)")
    parser.add_argument("--out", default=None, help="default: RUN/batch_costs.json")
    parser.add_argument("--batch-sizes", nargs="+", default=[str(b) for b in BATCH_SIZES])
    parser.add_argument("--widths", nargs="+", default=[str(w) for w in WIDTHS])
    parser.add_argument("--context", type=int, default=CONTEXT)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        run = Path(args.run)
        if not run.is_dir():
            raise ValueError(f"run {args.run!r} is not a folder: allowed is a run or sweep folder")
        costs = measure(run, parse_sizes(args.batch_sizes, "--batch-sizes"), parse_sizes(args.widths, "--widths"),
                        args.context, args.repeats)  # fmt: skip
    except ValueError as error:
        print(f"batch_costs: error: {error}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run / "batch_costs.json"
    atomic_replace(out, (json.dumps(costs, indent=2) + "\n").encode())
    print(f"batch_costs: wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
