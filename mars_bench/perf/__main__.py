"""``python -m mars_bench.perf [options]``: on the same prompts and budgets, in one process,
the methods' order rotating per prompt, each repeat timing at each temperature:

1. our autoregressive baseline, and transformers' ``generate`` (greedy only);
2. transformers' assisted generation (on models loaded as its users load them);
   with ``--peers vllm vllm-spec``, vLLM's CPU engine without and with its own speculative decoding;
3. our chain speculative decoding (``exact`` greedy, ``rejection`` at temperature 1) in every
   drafter configuration: each draft-length policy with each draft vocabulary, or the
   configurations ``--configs`` names one by one (these may also quantize the drafter's weights).

Writes ``perf.json`` (every number) and ``perf.md`` (speedups over our baseline and over
assisted generation with min / median / max over repeats, the phase profile, forward costs
and the analytic model) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mars_bench.bench.manifest import emulated_bf16_warning
from mars_bench.common.files import atomic_replace
from mars_bench.common.paths import CONF_DIR
from mars_bench.drafting.draft_weights import DRAFT_WEIGHTS
from mars_bench.perf.report import markdown
from mars_bench.perf.suite import PEER_METHODS, DraftConfig, PerfSettings, run_suite

CONF_MODELS = CONF_DIR / "model"


def parse(argv: list[str] | None) -> tuple[PerfSettings, Path]:
    parser = argparse.ArgumentParser(prog="python -m mars_bench.perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a conf/model option with a draft_model")
    parser.add_argument("--target", default=None, help="override the option's target (Hub id or folder)")
    parser.add_argument("--draft-model", default=None, help="override the option's draft model")
    parser.add_argument("--tasks", nargs="+", default=list(PerfSettings.tasks))
    parser.add_argument(
        "--num-prompts", type=int, default=PerfSettings.num_prompts, help="N prompts of each task (after --skip-prompts)"
    )
    parser.add_argument(
        "--skip-prompts", type=int, default=PerfSettings.skip_prompts, help="leave out each task's first N prompts (default 0)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=PerfSettings.max_new_tokens)
    parser.add_argument("--repeats", type=int, default=PerfSettings.repeats)
    parser.add_argument("--gamma", type=int, default=PerfSettings.gamma)
    parser.add_argument("--vllm-gamma", type=int, default=None,
                        help="vLLM's draft-model speculation's drafts a step, where its best is not ours (default: --gamma)")
    parser.add_argument(
        "--min-confidence",
        type=float,
        default=PerfSettings.min_confidence,
        help="the confidence policy's stop: end a draft after a token the drafter gives q below this",
    )
    parser.add_argument(
        "--draft-cost",
        type=float,
        default=PerfSettings.draft_cost,
        help="the gain policy's cost of one more drafted token, in target forwards (drafter forward / target forward)",
    )
    parser.add_argument(
        "--max-gamma", type=int, default=PerfSettings.max_gamma, help="the schedule policy's longest draft"
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        default=list(PEER_METHODS),
        help="the peers' methods to time: transformers' generate, assisted (assistant as loaded), "
        "assisted-like (the assistant with each configuration's draft weights), all three by default; vLLM's CPU "
        "engine, greedy, asked for by name: vllm (its AR), vllm-spec (its draft-model speculative decoding)",
    )
    parser.add_argument("--dtype", default=None, help="default: the model option's dtype")
    parser.add_argument("--kernels", default=PerfSettings.kernels, help="our models' linear layers on the CPU: auto (default), "
                        "onednn or stock (model.kernels); transformers' side always loads as its users do")  # fmt: skip
    parser.add_argument(
        "--draft-length",
        nargs="+",
        default=None,
        help="our draft-length policies: fixed (default), schedule, confidence (each is one configuration)",
    )
    parser.add_argument(
        "--draft-vocab",
        nargs="+",
        default=None,
        help="our drafter's vocabularies: none (all tokens, default) or K most frequent (each with each policy)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="POLICY[:K[+context][:WEIGHTS[:GUESSES]]]",
        help="configurations one by one instead, e.g. fixed confidence:32768 confidence:32768:int4 "
        "confidence:32768+context:int4:3 (K: the draft vocabulary, none for all, +context: and the context's "
        "tokens; WEIGHTS: int8 or int4, the drafter's quantized weights, none as loaded; GUESSES: drafter.guesses)",
    )
    parser.add_argument("--token-counts", default=None, help="a count file (.npy/.json) ranking the draft vocabulary")
    parser.add_argument(
        "--temperatures", nargs="+", type=float, default=list(PerfSettings.temperatures), help="0 (greedy), 1 (sampling), or both"
    )
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
        tasks=tuple(args.tasks), num_prompts=args.num_prompts, skip_prompts=args.skip_prompts, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, gamma=args.gamma, vllm_gamma=args.vllm_gamma, max_gamma=args.max_gamma,
        min_confidence=args.min_confidence,
        draft_cost=args.draft_cost, peers=tuple(args.peers),
        temperatures=tuple(args.temperatures),
        token_counts=args.token_counts, data_dir=args.data_dir, kernels=args.kernels, **draft_configs(args),
    )  # fmt: skip
    settings.check()
    return settings, Path(args.out)


def draft_configs(args: argparse.Namespace) -> dict[str, tuple]:
    """The drafter configurations asked for: ``--configs`` one by one (``POLICY``, ``POLICY:K``,
    ``POLICY:K:WEIGHTS`` or ``POLICY:K:WEIGHTS:GUESSES``; ``K+context``: K and the context's tokens), else
    each ``--draft-length`` with each ``--draft-vocab``. K, WEIGHTS, GUESSES and +context are the suite's drafter's
    settings ``draft_vocab``, ``weights``, ``guesses`` and ``context_vocab`` (the app's ``drafter.*`` keys)."""
    if args.configs is None:  # what is not given keeps PerfSettings' default
        product = {"draft_lengths": tuple(args.draft_length or ()),
                   "draft_vocabs": tuple(parse_vocab(value) for value in args.draft_vocab or ())}  # fmt: skip
        return {key: values for key, values in product.items() if values}
    if args.draft_length or args.draft_vocab:
        raise ValueError("--configs replaces --draft-length and --draft-vocab: allowed is one way or the other")
    configs: list[DraftConfig] = []
    for value in args.configs:
        length, _, rest = value.partition(":")
        vocab, _, rest = rest.partition(":")
        weights, _, guesses = rest.partition(":")
        weights = None if weights.lower() in ("", "none") else weights
        if weights:
            check_weights(weights, value)
        vocab, plus, added = vocab.partition("+")
        if plus and added != "context":
            raise ValueError(f"--configs {value} is invalid: allowed after K+ is context (the context's tokens too)")
        draft_vocab = parse_vocab(vocab, "--configs", value) if vocab else None
        config = DraftConfig.of(PerfSettings.drafter, length, draft_vocab=draft_vocab, weights=weights,
                                guesses=parse_guesses(guesses, value) if guesses else 0, context_vocab=bool(plus))  # fmt: skip
        if config in configs:
            raise ValueError(f"--configs {value} is given twice: allowed is each configuration once")
        configs.append(config)
    return {"draft_lengths": (), "draft_vocabs": (), "configurations": tuple(configs)}


def check_weights(weights: str, given: str) -> None:
    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"--configs {given} is invalid: allowed as weights are {', '.join(DRAFT_WEIGHTS)} (none: leave it out)")


def parse_guesses(value: str, given: str) -> int:
    if not value.isdigit():
        raise ValueError(f"--configs {given} is invalid: allowed as guesses are integers >= 0")
    return int(value)


def parse_vocab(value: str, option: str = "--draft-vocab", given: str | None = None) -> int | None:
    if value.lower() in ("none", "null", "all"):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{option} {given or value} is invalid: allowed as a vocabulary are none and integers >= 1") from None


def main(argv: list[str] | None = None) -> int:
    try:
        settings, out = parse(argv)
        out.mkdir(parents=True, exist_ok=True)
        slow_bf16 = emulated_bf16_warning(settings.dtype, None, kernels=settings.kernels)
        if slow_bf16:
            print(f"perf: warning: {slow_bf16}", file=sys.stderr)
        result = run_suite(settings, after_repeat=lambda report: write_report(report, out))
    except ValueError as error:
        print(f"perf: error: {error}", file=sys.stderr)
        return 2
    print(markdown(result))
    return 0


def write_report(report: dict[str, Any], out: Path) -> None:
    """perf.json and perf.md over the repeats done so far, each replaced whole."""
    for name, text in (("perf.json", json.dumps(report, indent=2)), ("perf.md", markdown(report))):
        atomic_replace(out / name, (text + "\n").encode())


if __name__ == "__main__":
    raise SystemExit(main())
