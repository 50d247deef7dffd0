"""Profile one speculative step of our engine, phase by phase: the draft model's forwards, the target's
verification forward, the verifier, the cache rollback, the bookkeeping, and what lies outside any operator.

    python benchmarks/spec_step_profile.py [--dtype bfloat16] [--gamma 5] [--num-prompts 2] [--max-new-tokens 64]
                                           [--kernels auto] [--out spec_step_profile]

The perf suite's method (``python -m mars_bench.perf --configs fixed``: our chain, the draft model as loaded,
``gamma`` drafts a step, the strict rule, greedy), through the same backend, on the first ``--num-prompts``
HumanEval and GSM8K first turns. After one warm-up decode, each prompt is decoded twice: once timed by wrappers
around the functions of each phase (``PhaseClock``: wall seconds only), once under ``torch.profiler`` (the
operators inside each phase). ``benchmarks/vllm_spec_profile.py`` profiles vLLM's step on the prompts this
writes (``prompts.json``), with the same phases. Written to ``--out``: ``ours.json`` and ``prompts.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile_ranges import PhaseClock, cpu_profile, phase_breakdown, write_result  # noqa: E402

from mars_bench.bench.manifest import cpu_description  # noqa: E402
from mars_bench.decoding import engine  # noqa: E402
from mars_bench.drafting.model import ModelDrafter  # noqa: E402
from mars_bench.models.kvcache import BatchCache  # noqa: E402
from mars_bench.perf.suite import OURS, DraftConfig, Method, PerfSettings, Suite  # noqa: E402

PHASES = ["step", "draft", "draft forward", "target forward", "verify", "cache rollback", "bookkeeping"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--draft-model", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="spec_step_profile")
    parser.add_argument("--kernels", default="auto", help="our models' linear layers on the CPU (model.kernels)")
    parser.add_argument("--no-profile", action="store_true",
                        help="the phase timings only: torch.profiler's trace of long decodes outgrows 24 GB")  # fmt: skip
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    config = DraftConfig.of("model", "fixed")
    settings = PerfSettings(args.target, args.draft_model, dtype=args.dtype, num_prompts=args.num_prompts,
                            max_new_tokens=args.max_new_tokens, repeats=1, gamma=args.gamma, configurations=(config,),
                            temperatures=(0.0,), peers=(), kernels=args.kernels)  # fmt: skip
    suite = Suite(settings)
    method = Method(OURS, 0.0, config)
    modules = suite.backend.forward_modules(suite.prepared[method])
    clock = PhaseClock()
    clock.wrap(engine._Batch, "step", "step")
    clock.wrap(ModelDrafter, "propose", "draft")
    clock.wrap(modules["drafter"], "forward", "draft forward")
    clock.wrap(modules["target"], "forward", "target forward")
    clock.wrap(engine._Batch, "judge", "verify")
    for name in ("commit", "forget"):
        clock.wrap(BatchCache, name, "cache rollback")
    clock.wrap(engine._Batch, "commit", "bookkeeping")

    suite.run(method, suite.prompts[0], 0, 8)  # warm-up
    runs, steps, tokens = [], 0, 0
    clock.reset()
    for index, prompt in enumerate(suite.prompts):
        run = suite.run(method, prompt, index, args.max_new_tokens)
        runs.append({key: run[key] for key in ("seconds", "steps", "prefill_s", "decode_s", "draft_s", "target_s",
                                                "verify_s", "bookkeeping_s")} | {"tokens": run["tokens"]})  # fmt: skip
        steps += run["steps"]
        tokens += len(run["tokens"])
    timed = clock.snapshot(steps)
    profile: dict = {}
    if not args.no_profile:
        with cpu_profile() as prof:
            profiled_steps = sum(suite.run(method, prompt, index, args.max_new_tokens)["steps"]
                                 for index, prompt in enumerate(suite.prompts))  # fmt: skip
        profile = phase_breakdown(prof, profiled_steps)
    suite.close()

    (out / "prompts.json").write_text(json.dumps({"prompts": suite.prompts, "tasks": suite.prompt_tasks,
                                                  "stops": suite.stops, "max_new_tokens": args.max_new_tokens}))  # fmt: skip
    write_result(out / "ours.json", "ours", PHASES, steps=steps, timed=timed, profile=profile, settings=vars(args),
                 cpu=cpu_description(), tokens=tokens, tokens_per_step=tokens / steps, runs=runs)  # fmt: skip

if __name__ == "__main__":
    main()
