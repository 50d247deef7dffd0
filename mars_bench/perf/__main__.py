"""``python -m mars_bench.perf [options]``: on the same prompts and budgets, in one process,
methods alternating per prompt, each repeat timing every pair:

1. our autoregressive baseline against ``model.generate`` (greedy);
2. our chain speculative decoding (``exact``) against assisted generation (greedy);
3. the same at temperature 1 with ``rejection`` against assisted sampling.

Writes ``perf.json`` (every number) and ``perf.md`` (ratios with min / median / max over
repeats, the phase profile, forward costs and the analytic model) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mars_bench.paths import CONF_DIR
from mars_bench.perf.report import markdown
from mars_bench.perf.suite import PerfSettings, run_suite

CONF_MODELS = CONF_DIR / "model"


def parse(argv: list[str] | None) -> tuple[PerfSettings, Path]:
    parser = argparse.ArgumentParser(prog="python -m mars_bench.perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a conf/model option with a draft_model")
    parser.add_argument("--target", default=None, help="override the option's target (Hub id or folder)")
    parser.add_argument("--draft-model", default=None, help="override the option's draft model")
    parser.add_argument("--tasks", nargs="+", default=["humaneval", "gsm8k"])
    parser.add_argument("--num-prompts", type=int, default=10, help="the first N prompts of each task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="default: the model option's dtype")
    parser.add_argument("--draft-length", default="fixed", help="our draft-length policy: fixed, schedule or confidence")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default="perf_out")
    args = parser.parse_args(argv)
    option = CONF_MODELS / f"{args.model}.yaml"
    if not option.is_file():
        choices = ", ".join(sorted(p.stem for p in CONF_MODELS.glob("*.yaml")))
        raise ValueError(f"--model {args.model!r} is unknown: allowed are {choices}")
    model = OmegaConf.merge(OmegaConf.load(option), {k: v for k, v in (("target", args.target),
                            ("draft_model", args.draft_model)) if v})  # fmt: skip
    if not model.get("draft_model"):
        raise ValueError(f"--model {args.model!r} has no draft_model: the suite compares draft-model speculative decoding")
    settings = PerfSettings(
        target=model.target, draft_model=model.draft_model, dtype=args.dtype or model.get("dtype", "bfloat16"),
        tasks=tuple(args.tasks), num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, gamma=args.gamma, draft_length=args.draft_length, data_dir=args.data_dir,
    )  # fmt: skip
    return settings, Path(args.out)


def main(argv: list[str] | None = None) -> int:
    try:
        settings, out = parse(argv)
        out.mkdir(parents=True, exist_ok=True)
        result = run_suite(settings, after_repeat=lambda report: write_report(report, out))
    except ValueError as error:
        print(f"perf: error: {error}", file=sys.stderr)
        return 2
    print(markdown(result))
    return 0


def write_report(report: dict[str, Any], out: Path) -> None:
    """perf.json and perf.md over the repeats done so far, each replaced whole."""
    for name, text in (("perf.json", json.dumps(report, indent=2)), ("perf.md", markdown(report))):
        partial = out / f"{name}.partial"
        partial.write_text(text + "\n")
        partial.replace(out / name)


if __name__ == "__main__":
    raise SystemExit(main())
