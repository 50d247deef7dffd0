"""Time a Llama-3.1-8B-shaped target with an EAGLE-3-shaped head (bf16, random weights).

    python benchmarks/gpu_tree_check.py [--tiny] [--prefix 512] [--repeats 20] [--out DIR]

Costs depend on shapes, not on weights, so no checkpoint is needed. Measured, each as the
median of ``--repeats`` timed calls after warm-up, with CUDA events on a GPU:
  - the target's forward over 1 token, over a gamma-6 chain (7 tokens), and over the root plus
    an EAGLE-2 tree of 49 nodes (depth 7, top-k 10, 50 tree tokens: the MARS paper's setting)
    drafted by the head, all on a ``--prefix``-token KV cache;
  - the head drafting that tree (7 head forwards and the expansion);
  - each verifier's decision on that tree at temperature 0 and 1 (one host sync included);
  - the engine's phase profile over a short ``mars`` decode beside the baseline.
Before timing, a correctness check in fp32 on a small config: ``exact`` over EAGLE-3 trees
decodes exactly like the baseline on this device.
``--tiny`` runs everything on a small config (a smoke test for machines without a GPU).
Writes ``gpu_tree_check.json`` and ``gpu_tree_check.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from mars_bench import decode
from mars_bench.common.trees import node_depths
from mars_bench.decoding.clock import Clock
from mars_bench.decoding.engine import block_parents
from mars_bench.drafting.eagle3 import Eagle3Drafter, Eagle3Settings, eagle3_head_from_state, random_head_state
from mars_bench.models.kvcache import cached_forward, crop_to
from mars_bench.models.loading import steady_attention_kernels
from mars_bench.verification import VerifyInput, available_verifiers, get_verifier
from mars_bench.verification.sampling import SamplingParams

LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
DEPTH, TOP_K, TREE_TOKENS, CHAIN = 7, 10, 50, 6


def build_target(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama of ``shape``, built directly on ``device`` in ``dtype``."""
    config = LlamaConfig(**shape, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    steady_attention_kernels(model)  # as load_model does
    return model.eval().requires_grad_(False)


def build_drafter(target: LlamaForCausalLM, draft_vocab: int, dtype: torch.dtype, device: torch.device) -> Eagle3Drafter:
    """An EAGLE-3-shaped head for ``target`` (random weights in the published layout)."""
    config = target.config
    head_config = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": config.rms_norm_eps,
    }
    state = random_head_state(head_config, device=device, scale=0.02)
    head = eagle3_head_from_state(head_config, state, target, dtype=dtype, device=device)
    return Eagle3Drafter(target, head, Eagle3Settings(top_k=TOP_K, tree_tokens=TREE_TOKENS))


def median_ms(call, clock: Clock, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        clock.lap()
        call()
        times.append(clock.lap() * 1000)
    return statistics.median(times)


def check_exact_over_trees(device: torch.device) -> dict[str, Any]:
    """fp32, small config: ``exact`` with EAGLE-3 trees equals the baseline token for token."""
    target = build_target(TINY, torch.float32, device, seed=1)
    drafter = build_drafter(target, 256, torch.float32, device)
    prompts = [[1, 5, 9, 2, 7, 30], [3, 3, 3, 8, 1, 4, 40, 41, 42], [11]]
    same = []
    for prompt in prompts:
        baseline = decode(target, None, None, prompt, max_new_tokens=40)
        method = decode(target, drafter, "exact", prompt, max_new_tokens=40, gamma=DEPTH)
        same.append(method.tokens == baseline.tokens)
    return {"prompts": len(prompts), "identical": sum(same)}


def measure(shape: dict[str, Any], device: torch.device, prefix: int, repeats: int, new_tokens: int) -> dict[str, Any]:
    dtype = torch.bfloat16
    target = build_target(shape, dtype, device)
    drafter = build_drafter(target, min(32000, shape["vocab_size"] // 2), dtype, device)
    clock = Clock(device)
    generator = torch.Generator(device=device).manual_seed(0)
    context = torch.randint(0, shape["vocab_size"], (prefix,), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    _, features = cached_forward(target, context[:-1], cache, hidden_layers=drafter.hidden_layers)
    drafter.begin([context[:-1]], [features])
    root = context[-1:].to(device)
    sample = SamplingParams(temperature=1.0)
    (draft,) = drafter.propose([context], [DEPTH], sample, [generator])
    tree_parents = block_parents(draft.parents)
    chain = torch.randint(0, shape["vocab_size"], (CHAIN,), device=device)

    def target_forward(tokens: torch.Tensor, parents: torch.Tensor | None = None, hidden: tuple[int, ...] = ()) -> torch.Tensor:
        logits, _ = cached_forward(target, tokens, cache, parents=parents, hidden_layers=hidden)
        crop_to(cache, prefix - 1)
        return logits

    tree_block = torch.cat([root, draft.tokens])
    results: dict[str, Any] = {
        "tree_nodes": len(draft),
        "tree_depth": int(node_depths(draft.parents).max()) + 1,
        "target_1_token_ms": median_ms(lambda: target_forward(root), clock, repeats),
        "target_chain_7_tokens_ms": median_ms(lambda: target_forward(torch.cat([root, chain])), clock, repeats),
        "target_tree_ms": median_ms(lambda: target_forward(tree_block, tree_parents), clock, repeats),
        "target_tree_with_features_ms": median_ms(
            lambda: target_forward(tree_block, tree_parents, drafter.hidden_layers), clock, repeats
        ),
        "head_tree_draft_ms": median_ms(lambda: drafter.propose([context], [DEPTH], sample, [generator]), clock, repeats),
    }
    logits = target_forward(tree_block, tree_parents)
    verify: dict[str, float] = {}
    for name in [name for name in available_verifiers() if not get_verifier(name).chains_only]:  # the ones that judge trees
        verifier = get_verifier(name)
        for label, sampling in (("t0", SamplingParams()), ("t1", sample)):
            step = VerifyInput(draft.tokens, draft.parents, logits, sampling, draft_probs=draft.probs)
            verify[f"{name}_{label}"] = median_ms(
                lambda verifier=verifier, step=step: verifier.verify(step, generator=generator), clock, repeats
            )
    results["verify_tree_ms"] = verify
    results["decode"] = profile_decode(target, drafter, context.tolist(), new_tokens)
    results["greedy_vs_generate"] = greedy_vs_generate(target, context.tolist(), new_tokens, clock)
    return results


def greedy_vs_generate(target: Any, prompt: list[int], new_tokens: int, clock: Clock, rounds: int = 3) -> dict[str, Any]:
    """Decode seconds (prefill included) of our greedy baseline and of ``target.generate``,
    alternating, ``rounds`` times each; tokens must agree."""
    ids = torch.tensor([prompt], device=target.device)
    times: dict[str, list[float]] = {"ours": [], "generate": []}
    same = True
    for _ in range(rounds):
        clock.lap()
        ours = decode(target, None, None, prompt, max_new_tokens=new_tokens, temperature=0.0)
        times["ours"].append(clock.lap())
        theirs = target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        times["generate"].append(clock.lap())
        same &= theirs[0, len(prompt) :].tolist() == ours.tokens
    return {
        "tokens": new_tokens,
        "ours_tokens_per_s": new_tokens / statistics.median(times["ours"]),
        "generate_tokens_per_s": new_tokens / statistics.median(times["generate"]),
        "same_tokens": same,
    }


def profile_decode(target: Any, drafter: Eagle3Drafter, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """The engine's per-step phase times for ``mars`` over EAGLE-3 trees, beside the baseline."""
    out = {}
    for label, method_drafter, verifier in (("baseline", None, None), ("mars_eagle3_tree", drafter, "mars")):
        decode(target, method_drafter, verifier, prompt, max_new_tokens=8, gamma=DEPTH, temperature=1.0)  # warm-up
        result = decode(target, method_drafter, verifier, prompt, max_new_tokens=new_tokens, gamma=DEPTH, temperature=1.0)
        phases = result.phase_seconds()
        steps = max(result.verify_steps, 1)
        out[label] = {
            "new_tokens": result.new_tokens,
            "steps": result.verify_steps,
            "tau": result.tau,
            "tokens_per_s": result.new_tokens / result.decode_s,
            "target_ms_median": statistics.median(step.target_s for step in result.steps) * 1000,
            "step_ms_median": statistics.median(
                (step.draft_s + step.target_s + step.verify_s + step.bookkeeping_s) for step in result.steps
            )
            * 1000,
            "per_step_ms": {phase: seconds * 1000 / steps for phase, seconds in phases.items()},
            "verify_share_of_decode": phases["verify"] / result.decode_s,
        }
    return out


def markdown(report: dict[str, Any]) -> str:
    m = report["measured"]
    lines = [
        f"# GPU tree check: {report['device_name']}, {report['shape']} target, bf16, prefix {report['prefix']} tokens",
        "",
        f"torch {report['torch']}, transformers {report['transformers']}; medians of {report['repeats']} timed calls.",
        f"Correctness (fp32, small config): exact over EAGLE-3 trees identical to the baseline on "
        f"{report['exact_check']['identical']} of {report['exact_check']['prompts']} prompts.",
        "",
        "| what | ms |",
        "|---|---|",
        f"| target forward, 1 token | {m['target_1_token_ms']:.2f} |",
        f"| target forward, chain of 1 + {CHAIN} tokens | {m['target_chain_7_tokens_ms']:.2f} |",
        f"| target forward, root + {m['tree_nodes']}-node tree (depth {m['tree_depth']}) | {m['target_tree_ms']:.2f} |",
        f"| same, with the three EAGLE-3 feature layers returned | {m['target_tree_with_features_ms']:.2f} |",
        f"| EAGLE-3 head drafting the tree (depth {DEPTH}, top-k {TOP_K}) | {m['head_tree_draft_ms']:.2f} |",
    ]
    lines += [f"| verifier `{name}` on the tree | {ms:.3f} |" for name, ms in m["verify_tree_ms"].items()]
    lines += ["", "| decode (T=1) | tokens | steps | tau | tok/s | draft ms/step | target ms/step | verify ms/step | "
              "bookkeeping ms/step | verify share | median target ms | median step ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, row in m["decode"].items():
        step = row["per_step_ms"]
        lines.append(
            f"| {label} | {row['new_tokens']} | {row['steps']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | "
            f"{step['draft']:.2f} | {step['target']:.2f} | {step['verify']:.3f} | {step['bookkeeping']:.3f} | "
            f"{row['verify_share_of_decode']:.2%} | {row['target_ms_median']:.2f} | {row['step_ms_median']:.2f} |"
        )
    g = m["greedy_vs_generate"]
    lines += ["", f"Greedy, {g['tokens']} tokens, prefill included: our baseline {g['ours_tokens_per_s']:.1f} tok/s, "
              f"`generate` {g['generate_tokens_per_s']:.1f} tok/s, same tokens: {g['same_tokens']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small config (smoke test; runs on a CPU)")
    parser.add_argument("--prefix", type=int, default=512, help="tokens in the KV cache before each timed forward")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per profiled decode")
    parser.add_argument("--out", type=Path, default=Path("gpu_tree_check_out"))
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        print("no GPU: run with --tiny for the smoke test", file=sys.stderr)
        return 2
    report = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": "tiny" if args.tiny else "Llama-3.1-8B",
        "prefix": args.prefix,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "exact_check": check_exact_over_trees(device),
        "measured": measure(TINY if args.tiny else LLAMA_8B, device, args.prefix, args.repeats, args.new_tokens),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_tree_check.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu_tree_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
