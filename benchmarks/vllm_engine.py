"""vLLM's engine against ours, and our verifier inside vLLM against vLLM's own rule, on the same prompts.

    python benchmarks/vllm_engine.py [--num-prompts 8] [--max-new-tokens 64] [--concurrency 1 8] [--repeats 2]
        [--ours-kernels auto stock] [--no-spec] [--generate] [--dtype bfloat16] [--out DIR]

The embedded pair (Qwen2.5-Coder 1.5B target, 0.5B draft model), bf16 unless ``--dtype``, greedy, HumanEval
first turns (both engines, and ``generate``, in the same dtype).
Per concurrency c (the requests vLLM serves at once: one ``generate`` call with every prompt and
``max_num_seqs`` = c, so a finished request's slot goes to a waiting one):

- ``vllm_ar``: vLLM without speculation;
- ``vllm_builtin``: vLLM's draft-model speculation (gamma drafts a step) judged by vLLM's own rule;
- ``vllm_plugin_exact``: the same speculation judged by our ``exact`` through the plugin;

builtin and plugin alternate, ``--repeats`` times each, on one loaded engine (the rule is swapped between
calls, nothing else changes; ``--no-spec`` leaves them out). Then ``ours_ar_<kernels>``: this package's own
autoregressive decoding of the same prompts, c at a time (``decode_batch``, no drafter), the engine the
harness's baselines use, once per ``--ours-kernels`` value (``model.kernels``, each its own load of the
target); with ``--generate``, at c = 1, transformers' ``generate`` on a stock load. Each row's
throughput is new tokens over the wall time of its calls; every spec row's tokens are checked against
vLLM's AR. Run it on an idle machine; it prints the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mars_bench.backends.vllm import VllmWorker, draft_model_config
from mars_bench.common.kernels import KERNELS
from mars_bench.decoding.batched import decode_batch
from mars_bench.models.loading import load_model, stop_token_ids
from mars_bench.models.sources import resolve_model
from mars_bench.perf.peer import load_peer, peer_generate, peer_generation_config
from mars_bench.perf.suite import first_turn_prompts
from mars_bench.serving.install import vllm_python

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def worker(label: str, concurrency: int, gamma: int | None, folder: Path, dtype: str = "bfloat16") -> VllmWorker:
    speculative = None if gamma is None else draft_model_config(str(resolve_model(DRAFT).path), gamma)
    started = VllmWorker(vllm_python(), None if gamma is None else {"name": None}, folder, label)
    started.ask({"op": "load", "model": str(resolve_model(TARGET).path), "dtype": dtype, "seed": 0,
                 "max_model_len": 4096, "max_num_seqs": concurrency, "speculative_config": speculative})  # fmt: skip
    return started


def vllm_run(engine: VllmWorker, prompts: list[list[int]], max_new_tokens: int, stops: list[int]) -> dict[str, Any]:
    answer = engine.ask({"op": "generate", "prompts": prompts, "seeds": [0] * len(prompts), "max_new_tokens": max_new_tokens,
                         "stop_token_ids": stops, "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}})  # fmt: skip
    tokens = [result["tokens"] for result in answer["results"]]
    steps = [step for result in answer["results"] for step in result["steps"][1:]]
    return {"seconds": answer["wall_s"], "new_tokens": sum(map(len, tokens)), "tokens": tokens,
            "tau": (sum(s["accepted"] + 1 for s in steps) / len(steps)) if steps else None}  # fmt: skip


def generate_run(target: Any, prompts: list[list[int]], max_new_tokens: int, stops: list[int],
                 dtype: str = "bfloat16") -> dict[str, Any]:  # fmt: skip
    """transformers' ``generate``, greedy, one prompt at a time, on the target loaded as its users load it."""
    stock = load_peer(target.resolved.path, dtype)
    config = peer_generation_config(max_new_tokens, 0.0, stops, stops[0])
    peer_generate(stock, prompts[0], peer_generation_config(8, 0.0, stops, stops[0]))  # warm-up
    started = time.perf_counter()
    tokens = [peer_generate(stock, prompt, config) for prompt in prompts]
    return {"seconds": time.perf_counter() - started, "new_tokens": sum(map(len, tokens)), "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ours", action=argparse.BooleanOptionalAction, default=True, help="time our AR too")
    parser.add_argument("--ours-kernels", nargs="+", default=["auto"], choices=KERNELS,
                        help="our AR once per model.kernels value (each on its own load of the target)")
    parser.add_argument("--spec", action=argparse.BooleanOptionalAction, default=True,
                        help="time vLLM's speculation (its rule and our exact through the plugin)")
    parser.add_argument("--generate", action=argparse.BooleanOptionalAction, default=False,
                        help="time transformers' generate too (at concurrency 1, a stock load of the target)")
    parser.add_argument("--dtype", default="bfloat16", help="of every model: float32 on a CPU without native bf16")
    parser.add_argument("--out", type=Path, default=Path("vllm_engine_out"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    kernel_runs = args.ours_kernels if args.ours else []
    targets = {kernels: load_model(TARGET, dtype=args.dtype, kernels=kernels) for kernels in kernel_runs}
    first = next(iter(targets.values())) if targets else load_model(TARGET, dtype=args.dtype, kernels="stock")
    stops = stop_token_ids(first)
    prompts = first_turn_prompts(first.tokenizer, "humaneval", args.num_prompts)
    rows: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp(prefix="vllm_engine_"))

    def add(name: str, concurrency: int, run: dict[str, Any], reference: list[list[int]] | None) -> None:
        row = {"name": name, "concurrency": concurrency, "seconds": run["seconds"], "new_tokens": run["new_tokens"],
               "tok_s": run["new_tokens"] / run["seconds"], "tau": run.get("tau"),
               "same_tokens_as_vllm_ar": None if reference is None else run["tokens"] == reference}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)

    for concurrency in args.concurrency:
        ar = worker(f"ar{concurrency}", concurrency, None, folder, args.dtype)
        vllm_run(ar, prompts[:1], 8, stops)  # warm-up
        reference = vllm_run(ar, prompts, args.max_new_tokens, stops)
        add("vllm_ar", concurrency, reference, None)
        ar.close()
        if args.spec:
            spec = worker(f"spec{concurrency}", concurrency, args.gamma, folder, args.dtype)
            vllm_run(spec, prompts[:1], 8, stops)
            for _ in range(args.repeats):
                for name, rule in (("vllm_builtin", None), ("vllm_plugin_exact", "exact")):
                    spec.ask({"op": "verifier", "verifier": {"name": rule, "settings": {}}})
                    add(name, concurrency, vllm_run(spec, prompts, args.max_new_tokens, stops), reference["tokens"])
            spec.close()
        for kernels, target in targets.items():
            decode_batch(target.model, None, None, [prompts[0]], seeds=[0], max_new_tokens=8, stop_token_ids=stops)
            started, tokens = time.perf_counter(), []
            for start in range(0, len(prompts), concurrency):
                chunk = prompts[start : start + concurrency]
                results = decode_batch(target.model, None, None, chunk, seeds=[0] * len(chunk),
                                       max_new_tokens=args.max_new_tokens, stop_token_ids=stops)  # fmt: skip
                tokens += [result.tokens for result in results]
            ours = {"seconds": time.perf_counter() - started, "new_tokens": sum(map(len, tokens)), "tokens": tokens}
            add(f"ours_ar_{kernels}", concurrency, ours, reference["tokens"])
        if args.generate and concurrency == 1:
            generated = generate_run(first, prompts, args.max_new_tokens, stops, args.dtype)
            add("transformers_generate", 1, generated, reference["tokens"])
    report = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()},
              "prompts": len(prompts), "rows": rows,
              "ours_packed": {kernels: target.packed.describe() if target.packed else None
                              for kernels, target in targets.items()}}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"cpu: {report['cpu']}; written {args.out / 'results.json'}")


if __name__ == "__main__":
    main()
