"""Profile one step of vLLM's draft-model speculative decoding, phase by phase, beside ours
(``benchmarks/spec_step_profile.py``, which writes the prompts this reads). Run it in vLLM's environment:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=.:benchmarks \\
        ~/.cache/mars_bench/vllm-env/bin/python benchmarks/vllm_spec_profile.py --prompts OUT/prompts.json --out OUT

The engine is loaded as the perf suite's ``vllm-spec`` peer loads it (``serving/vllm_worker.py``'s ``Worker.load``:
``enforce_eager=True``, ``max_num_seqs=1``, the draft model with ``--gamma`` drafts), in this process so that its
functions can be wrapped: the engine step (a request's first step, its prefill, left out), the target's forward,
the drafting (and the draft model's forwards inside it), the rejection sampler, the scheduler, the input
preparation and the bookkeeping. Each prompt is generated once timed by the wrappers and once under
``torch.profiler``, after one warm-up request. Written: ``vllm.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from step_profile_ranges import OUTER, PhaseClock, cpu_profile, phase_breakdown, write_result

from mars_bench.bench.manifest import cpu_description
from mars_bench.serving.vllm_worker import Worker

PHASES = ["step", "schedule", "inputs", "target forward", "verify", "draft", "draft forward", "bookkeeping", "output"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(Path.home() / ".cache/mars_bench/models/Qwen--Qwen2.5-Coder-1.5B-Instruct"))
    parser.add_argument("--draft-model", default=str(Path.home() / ".cache/mars_bench/models/Qwen--Qwen2.5-Coder-0.5B-Instruct"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    given = json.loads(Path(args.prompts).read_text())

    import vllm
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from mars_bench.backends.vllm import MAX_MODEL_LEN, draft_model_config

    worker = Worker()
    worker.load({"op": "load", "model": args.target, "dtype": args.dtype, "seed": 0, "max_model_len": MAX_MODEL_LEN,
                 "max_num_seqs": 1, "enforce_eager": True,
                 "speculative_config": draft_model_config(args.draft_model, args.gamma)})  # fmt: skip
    core = worker.llm.llm_engine.engine_core.engine_core
    clock = PhaseClock()
    clock.wrap(core, "step_fn", lambda _: "prefill step" if len(core.scheduler.waiting) else OUTER)
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "output")
    clock.wrap(GPUModelRunner, "_prepare_inputs", "inputs")
    clock.wrap(GPUModelRunner, "_model_forward", "target forward")
    clock.wrap(GPUModelRunner, "propose_draft_token_ids", "draft")
    clock.wrap(Qwen2ForCausalLM, "forward", lambda open_: "draft forward" if "draft" in open_ else None)
    clock.wrap(RejectionSampler, "forward", "verify")
    clock.wrap(GPUModelRunner, "_bookkeeping_sync", "bookkeeping")

    def generate(prompt: list[int], tokens: int) -> dict:
        return worker.generate({"op": "generate", "prompts": [prompt], "seeds": [0], "max_new_tokens": tokens,
                                "stop_token_ids": given["stops"],
                                "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}})  # fmt: skip

    def decode_steps(answer: dict) -> int:
        return answer["counters"]["num_drafts"] if answer.get("counters") else 0

    generate(given["prompts"][0], 8)  # warm-up
    clock.reset()
    runs, steps, tokens = [], 0, 0
    for prompt in given["prompts"]:
        answer = generate(prompt, given["max_new_tokens"])
        result = answer["results"][0]
        runs.append({"seconds": answer.get("wall_s"), "steps": decode_steps(answer), "tokens": result["tokens"]})
        steps += decode_steps(answer)
        tokens += len(result["tokens"])
    timed = clock.snapshot(steps)
    with cpu_profile() as prof:
        profiled_steps = sum(decode_steps(generate(prompt, given["max_new_tokens"])) for prompt in given["prompts"])
    profile = phase_breakdown(prof, profiled_steps)

    write_result(Path(args.out, "vllm.json"), "vllm", PHASES, steps=steps, timed=timed, profile=profile,
                 vllm=vllm.__version__, settings=vars(args), cpu=cpu_description(), tokens=tokens, runs=runs)  # fmt: skip

if __name__ == "__main__":
    main()
