"""SDPA reading grouped-query attention's shared key and value heads as they are (``enable_gqa``) against
transformers' copy of them per query head, on the embedded pair, switched per call in one process.

    python benchmarks/sdpa_gqa.py forwards [--dtype bfloat16] [--contexts 200 700] [--out FILE]
    python benchmarks/sdpa_gqa.py decode [--max-new-tokens 384] [--out FILE]

``forwards``: the target's 6-token and the draft model's 6-token forward after a cached random context of each
length, each pair the copy first, 8 timed pairs after 2 warm-up ones; the logits compared bit for bit.
``decode``: our chain (the perf suite's ``--configs fixed``: the draft model as loaded, 5 drafts a step, greedy)
on the first HumanEval and GSM8K prompts, each decoded with both settings in alternating order, twice; the tokens
compared. transformers reads ``TRANSFORMERS_SDPA_FORCE_GQA`` at each attention call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from mars_bench.bench.manifest import cpu_description
from mars_bench.models.kvcache import cached_forward, crop_to, new_cache
from mars_bench.models.loading import SDPA_GQA
from mars_bench.perf.suite import OURS, DraftConfig, Method, PerfSettings, Suite

SETTINGS = {"copied": "0", "read as they are": "1"}


def forwards(suite: Suite, method: Method, contexts: list[int]) -> list[dict]:
    modules = suite.backend.forward_modules(suite.prepared[method])
    block = torch.tensor([5, 6, 7, 8, 9, 10])
    rows = []
    for context in contexts:
        prefix = torch.randint(100, 20000, (context,), generator=torch.Generator().manual_seed(context))
        caches = {role: new_cache(model) for role, model in modules.items()}
        times: dict[tuple[str, str], list[float]] = {}
        logits: dict[tuple[str, str], torch.Tensor] = {}
        with torch.inference_mode():
            for role, model in modules.items():
                cached_forward(model, prefix, caches[role], last_only=True)
            for repeat in range(10):
                for name, value in SETTINGS.items():
                    os.environ[SDPA_GQA] = value
                    for role, model in modules.items():
                        start = time.perf_counter()
                        logits[role, name] = cached_forward(model, block, caches[role])[0]
                        if repeat >= 2:
                            times.setdefault((role, name), []).append((time.perf_counter() - start) * 1e3)
                        crop_to(caches[role], context)
        for role in modules:
            rows.append({"context": context, "model": role, **{f"ms {name}": round(statistics.median(times[role, name]), 1)
                                                                for name in SETTINGS},
                         "identical": torch.equal(*(logits[role, name] for name in SETTINGS))})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def decodes(suite: Suite, method: Method, max_new_tokens: int) -> list[dict]:
    suite.run(method, suite.prompts[0], 0, 16)  # warm-up
    rows = []
    for repeat in range(2):
        for index, prompt in enumerate(suite.prompts):
            order = list(SETTINGS) if (repeat + index) % 2 == 0 else list(SETTINGS)[::-1]
            runs = {}
            for name in order:
                os.environ[SDPA_GQA] = SETTINGS[name]
                runs[name] = suite.run(method, prompt, index, max_new_tokens)
            rows.append({"repeat": repeat, "prompt": index, "order": order, "tokens": len(runs[order[0]]["tokens"]),
                         **{f"s {name}": round(runs[name]["seconds"], 2) for name in SETTINGS},
                         "ratio read / copied": round(runs["read as they are"]["seconds"] / runs["copied"]["seconds"], 3),
                         "identical": runs["copied"]["tokens"] == runs["read as they are"]["tokens"]})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["forwards", "decode"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[200, 700])
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = DraftConfig.of("model", "fixed")
    settings = PerfSettings("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype=args.dtype,
                            num_prompts=1, max_new_tokens=args.max_new_tokens, repeats=1, gamma=5,
                            configurations=(config,), temperatures=(0.0,), peers=())  # fmt: skip
    suite = Suite(settings)
    method = Method(OURS, 0.0, config)
    rows = forwards(suite, method, args.contexts) if args.mode == "forwards" else decodes(suite, method, args.max_new_tokens)
    suite.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "cpu": cpu_description(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
