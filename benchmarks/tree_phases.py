"""Time the drafting and verify phases per step of the two tree drafters.

    python benchmarks/tree_phases.py [--cases eagle3 model_tree] [--prompts 5] [--max-new-tokens 64]
                                     [--repeats 3] [--out tree_phases.json]

Cases:
  eagle3      the tiny random EAGLE-3 head of tests/test_eagle3.py on its tiny random 4-layer
              Llama target (vocabulary 96, draft vocabulary 40; fp32), on token prompts.
  model_tree  the embedded pair: target Qwen2.5-Coder-1.5B-Instruct, drafter
              Qwen2.5-Coder-0.5B-Instruct (bf16), on the first ``--prompts`` HumanEval questions.
Each case decodes every prompt with ``exact`` at temperature 0 and ``mars`` at temperature 1,
after one untimed warm-up decode, ``--repeats`` times; the engine's own phase clock
(``DecodeResult.phase_seconds``, synchronised with the device) gives the seconds. Printed: ms
per step of each phase (total phase seconds over all steps), and the median step's draft and
verify ms, as a Markdown table; written: the same as JSON to ``--out``, with the code's origin.

It imports only APIs that the code before and after the tree-phase rework both have, so the same script
times either checkout: ``PYTHONPATH=/path/to/checkout python benchmarks/tree_phases.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mars_bench
from mars_bench import build_drafter, decode
from mars_bench.drafting.eagle3 import Eagle3Drafter, Eagle3Settings, eagle3_head_from_state, random_head_state

TINY_PROMPTS = [[1, 5, 9, 2, 7, 33, 12, 5, 9], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3], [11, 60, 2, 17, 80, 5]]
METHODS = (("exact", 0.0), ("mars", 1.0))  # (verifier, temperature)
PHASES = ("draft", "target", "verify", "bookkeeping")


def tiny_eagle3(device: torch.device) -> tuple[Any, Eagle3Drafter]:
    """The tests' tiny random target (tests/conftest.py ``tiny_model``) and EAGLE-3 head (tests/test_eagle3.py)."""
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.2,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval().requires_grad_(False).to(device)
    head_config = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": 1, "vocab_size": 96, "draft_vocab_size": 40, "rms_norm_eps": 1e-5}  # fmt: skip
    head = eagle3_head_from_state(head_config, random_head_state(head_config, 0), target, dtype=torch.float32, device=device)
    return target, Eagle3Drafter(target, head, Eagle3Settings())


def embedded_pair(prompts: int) -> tuple[Any, Any, list[list[int]], list[int]]:
    """(target, model_tree drafter, HumanEval prompt ids, stop ids) of the embedded Qwen pair, bf16."""
    from mars_bench.models.loading import check_tokenizers_compatible, load_model, stop_token_ids
    from mars_bench.perf.suite import first_turn_prompts

    target = load_model("Qwen/Qwen2.5-Coder-1.5B-Instruct", dtype="bfloat16")
    draft_model = load_model("Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype="bfloat16")
    check_tokenizers_compatible(target.tokenizer, draft_model.tokenizer)
    ids = first_turn_prompts(target.tokenizer, "humaneval", prompts)
    drafter = build_drafter("model_tree", model=draft_model.model, vocab_size=target.model.config.vocab_size)
    return target.model, drafter, ids, stop_token_ids(target)


def time_method(run: Callable[..., Any], prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Phase seconds of ``run(prompt, seed)`` over every prompt, ``repeats`` times: ms per step
    per phase (phase seconds over all steps) and the median step's draft and verify ms."""
    run(prompts[0], 0)  # warm-up
    totals = dict.fromkeys(PHASES, 0.0)
    steps, tokens, drafted, per_step_draft, per_step_verify = 0, 0, 0, [], []
    for _ in range(repeats):
        for seed, prompt in enumerate(prompts):
            result = run(prompt, seed)
            for phase, seconds in result.phase_seconds().items():
                totals[phase] += seconds
            steps += result.verify_steps
            tokens += result.new_tokens
            drafted += result.drafted
            per_step_draft += [step.draft_s for step in result.steps]
            per_step_verify += [step.verify_s for step in result.steps]
    per_step = max(steps, 1)
    return {
        "steps": steps,
        "new_tokens": tokens,
        "drafted_per_step": drafted / per_step,
        "ms_per_step": {phase: seconds * 1000 / per_step for phase, seconds in totals.items()},
        "median_draft_ms": statistics.median(per_step_draft) * 1000 if per_step_draft else float("nan"),
        "median_verify_ms": statistics.median(per_step_verify) * 1000 if per_step_verify else float("nan"),
    }


def time_case(target: Any, drafter: Any, prompts: list[list[int]], stops: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Every method of ``METHODS`` over ``prompts`` with ``drafter``."""
    out = {}
    for verifier, temperature in METHODS:

        def run(prompt: list[int], seed: int, verifier: str = verifier, temperature: float = temperature) -> Any:
            return decode(target, drafter, verifier, prompt, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                          temperature=temperature, stop_token_ids=stops, seed=seed)  # fmt: skip

        out[f"{verifier}_t{temperature:g}"] = time_method(run, prompts, args.repeats)
    return out


def code_origin() -> dict[str, Any]:
    """Where the imported mars_bench comes from: its folder, and its git commit and dirty flag if any."""
    folder = Path(mars_bench.__file__).resolve().parents[1]

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(folder), *argv], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"path": str(folder), "commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain"))}


def markdown(report: dict[str, Any]) -> str:
    origin = report["code"]
    lines = [
        f"Code: {origin['path']} at {origin['commit']}{' (dirty)' if origin['dirty'] else ''}; device {report['device']}, "
        f"torch {report['torch']}, {report['threads']} threads; {report['max_new_tokens']} new tokens, gamma {report['gamma']}.",
        "",
        "| case | method | steps | drafted/step | draft ms/step | verify ms/step | target ms/step | bookkeeping ms/step "
        "| median draft ms | median verify ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, methods in report["cases"].items():
        for method, row in methods.items():
            ms = row["ms_per_step"]
            lines.append(
                f"| {case} | {method} | {row['steps']} | {row['drafted_per_step']:.1f} | {ms['draft']:.3f} | "
                f"{ms['verify']:.3f} | {ms['target']:.3f} | {ms['bookkeeping']:.3f} | {row['median_draft_ms']:.3f} | "
                f"{row['median_verify_ms']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=("eagle3", "model_tree"), default=["eagle3", "model_tree"])
    parser.add_argument("--prompts", type=int, default=5, help="HumanEval questions for model_tree (eagle3: at most 3)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=7, help="tree depth")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("tree_phases.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases: dict[str, Any] = {}
    with torch.inference_mode():
        if "eagle3" in args.cases:
            target, drafter = tiny_eagle3(device)
            cases["eagle3"] = time_case(target, drafter, TINY_PROMPTS[: max(1, min(args.prompts, 3))], [], args)
        if "model_tree" in args.cases:
            target, drafter, prompts, stops = embedded_pair(args.prompts)
            cases["model_tree"] = time_case(target, drafter, prompts, stops, args)
    report = {
        "code": code_origin(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "gamma": args.gamma,
        "repeats": args.repeats,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
