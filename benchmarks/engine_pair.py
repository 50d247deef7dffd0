"""Measure the engine on the embedded Qwen pair: tau, tokens/s and speedup per verifier.

    python benchmarks/engine_pair.py [--prompts 10] [--max-new-tokens 128] [--out FILE]

Baseline and each method run on the same prompts, alternating per prompt, in one process,
after one warm-up; greedy methods against the greedy baseline, sampled ones against the
sampled baseline. Writes one JSON line per (prompt, method) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from mars_bench import build_drafter, decode, get_verifier
from mars_bench.models import check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.perf.suite import first_turn_prompts

METHODS = [  # (label, temperature, verifier, verifier params); verifier None = baseline
    ("baseline_t0", 0.0, None, {}),
    ("exact_t0", 0.0, "exact", {}),
    ("baseline_t1", 1.0, None, {}),
    ("rejection_t1", 1.0, "rejection", {}),
    ("mars_t1", 1.0, "mars", {"theta": 0.9}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--out", default="runs/engine_pair.jsonl")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    target = load_model("Qwen/Qwen2.5-Coder-1.5B-Instruct", dtype="bfloat16")
    draft_model = load_model("Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype="bfloat16")
    check_tokenizers_compatible(target.tokenizer, draft_model.tokenizer)
    stops = stop_token_ids(target)
    prompts = first_turn_prompts(target.tokenizer, "humaneval", args.prompts)
    drafter = build_drafter("model", model=draft_model.model, vocab_size=target.model.config.vocab_size)

    def run(label, temperature, verifier, params, prompt, seed, max_new_tokens=args.max_new_tokens):
        return decode(
            target.model,
            drafter if verifier else None,
            get_verifier(verifier, **params) if verifier else None,
            prompt,
            max_new_tokens=max_new_tokens,
            gamma=args.gamma,
            temperature=temperature,
            stop_token_ids=stops,
            seed=seed,
        )

    for method in METHODS:  # warm-up
        run(*method, prompts[0], 0, max_new_tokens=16)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with out.open("w") as handle:
        for index, prompt in enumerate(prompts):
            order = METHODS if index % 2 == 0 else METHODS[::-1]
            for label, temperature, verifier, params in order:
                result = run(label, temperature, verifier, params, prompt, seed=index)
                row = {
                    "prompt": index,
                    "method": label,
                    "new_tokens": result.new_tokens,
                    "steps": result.verify_steps,
                    "tau": result.tau,
                    "drafted": result.drafted,
                    "accepted": result.accepted,
                    "relaxed": result.relaxed,
                    "decode_s": result.decode_s,
                    "prefill_s": result.prefill_s,
                    "phases": result.phase_seconds(),
                    "tokens": result.tokens,
                }
                rows.append(row)
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                print(
                    f"prompt {index} {label}: {result.new_tokens} tokens, tau {result.tau:.2f}, "
                    f"{result.tokens_per_s:.2f} tok/s",
                    flush=True,
                )
    summarise(rows)


def summarise(rows: list[dict]) -> None:
    by_method: dict[str, dict[str, float]] = {}
    for row in rows:
        agg = by_method.setdefault(row["method"], {"tokens": 0, "seconds": 0.0, "emitted": 0, "steps": 0, "relaxed": 0})
        agg["tokens"] += row["new_tokens"]
        agg["seconds"] += row["decode_s"] + row["prefill_s"]
        agg["emitted"] += row["new_tokens"] - 1
        agg["steps"] += row["steps"]
        agg["relaxed"] += row["relaxed"]
    baseline_rows = {row["prompt"]: row["tokens"] for row in rows if row["method"] == "baseline_t0"}
    print("\n| method | tokens | tok/s | tau | speedup vs baseline (same temperature) | relaxed |")
    print("|---|---|---|---|---|---|")
    for method, agg in by_method.items():
        base = by_method["baseline_t0" if method.endswith("t0") else "baseline_t1"]
        rate = agg["tokens"] / agg["seconds"]
        speedup = rate / (base["tokens"] / base["seconds"])
        tau = agg["emitted"] / agg["steps"]
        print(f"| {method} | {agg['tokens']} | {rate:.2f} | {tau:.2f} | {speedup:.2f}x | {agg['relaxed']} |")
    same = sum(row["tokens"] == baseline_rows[row["prompt"]] for row in rows if row["method"] == "exact_t0")
    print(f"\nexact_t0 outputs identical to baseline_t0 (bf16): {same}/{len(baseline_rows)}")


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"wall time {time.time() - started:.0f} s")
