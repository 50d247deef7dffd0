"""Summarise py-spy's folded stacks (``py-spy record --format raw``) of the two step profiles.

    python benchmarks/pyspy_summary.py OURS.folded VLLM.folded [--top 12] [--out summary.json]

Only the samples inside a decoding step (ours: ``_Batch.step``; vLLM: ``EngineCore.step``) of the scripts' pass
without torch.profiler count. For each file: those samples, the share passing through each phase's function
(ours: ``propose``, the target's ``forward``, ``judge``; vLLM: ``propose_draft_token_ids``, ``_model_forward``, the
rejection sampler), and the functions the samples were in (the innermost Python frame: time in a C++ operator
counts for the Python line that called it), the ``--top`` largest. A Markdown table per file goes to standard
output, the numbers to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

MARKERS = {  # phase -> the frames (py-spy's "Class.function (file:line)") a stack passes through, ours then vLLM's
    "step": ("_Batch.step (mars_bench/decoding/engine.py", "EngineCore.step (vllm/v1/engine/core.py"),
    "draft": ("ModelDrafter.propose (", "GPUModelRunner.propose_draft_token_ids ("),
    "target forward": ("Qwen2ForCausalLM.forward (transformers/", "GPUModelRunner._model_forward ("),
    "verify": ("_Batch.judge (", "RejectionSampler.forward ("),
}
# the profiling scripts' second pass, under torch.profiler, left out: both run it in a generator expression in main
PROFILED = "main.<locals>.<genexpr> ("
FRAME = re.compile(r"^(?P<name>[^ ]+) \((?P<file>[^:]+)(?::\d+)?\)$")


def short_file(path: str) -> str:
    for anchor in ("site-packages/", "mars_bench/", "benchmarks/"):
        if anchor in path:
            return (anchor if anchor != "site-packages/" else "") + path.split(anchor, 1)[1]
    return path


def summarise(path: Path, top: int) -> dict:
    """One folded-stack file: its samples inside steps, per phase the samples and their share of those (a fraction,
    0 to 1), and the ``top`` innermost functions with their samples and share."""
    samples: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if any(PROFILED in frame for frame in frames) or not any(m in f for f in frames for m in MARKERS["step"]):
            continue  # only the steps of the pass that ran without torch.profiler
        passes = {phase for phase, markers in MARKERS.items() if any(m in frame for frame in frames for m in markers)}
        if "draft" in passes:
            passes.discard("target forward")  # ours: the draft model is a Qwen2ForCausalLM too
        for phase in passes:
            phases[phase] += count
        match = FRAME.match(frames[-1].strip())
        leaf = f"{match['name']} ({short_file(match['file'])})" if match else frames[-1]
        samples[leaf] += count
        total += count
    step = phases.get("step", 0) or 1
    return {"file": path.name, "step_samples": total,
            "phases": {phase: {"samples": n, "share_of_step": round(n / step, 4)} for phase, n in phases.items()},
            "innermost": [{"function": name, "samples": n, "share": round(n / total, 4)}
                          for name, n in samples.most_common(top)]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    summaries = [summarise(path, args.top) for path in args.files]
    for summary in summaries:
        print(f"\n{summary['file']}: {summary['step_samples']} samples in steps; of them: "
              + ", ".join(f"{phase} {value['share_of_step']:.1%}" for phase, value in summary["phases"].items()))
        print("| innermost Python function | share of samples |\n|---|---|")
        for row in summary["innermost"]:
            print(f"| `{row['function']}` | {row['share']:.1%} |")
    if args.out:
        args.out.write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
