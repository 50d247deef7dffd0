"""Where a forward's time goes on the CPU, and what each candidate kernel setting makes of it.

    python benchmarks/forward_kernels.py [--candidates stock onednn1 onednn16 onednn32 compile] [--profile] [--out DIR]

On the embedded pair (Qwen2.5-Coder 1.5B target, 0.5B drafter), bf16 unless ``--dtype``, after a
``--context``-token cached prefix of random ids (a HumanEval prompt is about 150 tokens), as the engine runs
them: a batch of one through ``cached_logits`` (no mask), a batch of B through ``batch_forward`` (the 4D
mask of the batched engine). Per candidate, the median of ``--repeats`` timed forwards after a warm-up:

- target, B = 1: one token (an AR step), 6 tokens (a gamma-5 verification);
- target, B = 4: one token per row;
- drafter, B = 1: one token, and a 120-token prefill;
- with ``--widths``: the target at B = 1 over each of these widths (a verification forward is gamma + 1 wide).

Candidates: ``stock`` (the models as loaded); ``onednnN`` (``cpu_linear.pack_linears``, the packed layout
chosen for N rows; ``onednn``: the engine's default, ``PACK_BATCH_HINT``); ``compile`` (``torch.compile``
with inductor's freezing, which packs the linear weights for oneDNN in the graph; its compile time is reported apart). The
drafter's quantized weights ``int4`` and ``int8`` (``draft_weights.quantized_draft_model``) are timed on
the drafter as loaded. ``--profile``: an operator profile (torch.profiler, self CPU time) of the target's
one-token forward at B = 1 and B = 4, of ``generate`` (16 tokens with their prefill) and of a drafter
step, per candidate in ``--profile-candidates``. ``--equality N``: our AR on packed layers against
``generate`` on a stock load, on N HumanEval prompts, with the logit gap where they part. Also the
machine's own limits: GB/s reading memory and GFLOP/s of a large matrix product. ``--threads`` sets torch's
threads; the OpenMP affinity variables and ``LD_PRELOAD``, set around the command, are recorded. Writes
``results.json`` and prints the CPU it ran on.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mars_bench.bench.manifest import cpu_description
from mars_bench.drafting.draft_weights import quantized_draft_model
from mars_bench.models.cpu_linear import PACK_BATCH_HINT, pack_linears, unpack_linears
from mars_bench.models.kvcache import cached_logits, crop_to, new_cache
from mars_bench.models.loading import load_model
from mars_bench.perf.batch_costs import batch_forward_seconds
from mars_bench.perf.costs import forward_seconds

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
PREFILL = 120  # drafter prefill tokens (a prompt's worth)
AFFINITY_ENV = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "LD_PRELOAD")  # recorded as set


@torch.inference_mode()
def prefill_seconds(model: Any, tokens: int, repeats: int) -> float:
    """Median seconds of a ``tokens``-token prefill into an empty cache (logits of the last only)."""
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(repeats + 1):
        cache = new_cache(model)
        start = time.perf_counter()
        cached_logits(model, ids, cache, last_only=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def model_cases(model: Any, name: str, context: int, repeats: int, batch: int) -> dict[str, float]:
    if name == "target":
        seconds = {"target_b1_w1": forward_seconds(model, context, 1, repeats),
                   "target_b1_w6": forward_seconds(model, context, 6, repeats)}  # fmt: skip
        seconds[f"target_b{batch}_w1"] = batch_forward_seconds(model, batch, (1,), context, repeats)[1]
        return seconds
    return {f"{name}_w1": forward_seconds(model, context, 1, repeats),
            f"{name}_prefill{PREFILL}": prefill_seconds(model, PREFILL, 3)}


@torch.inference_mode()
def op_profile(run: Any, steps: int, top: int = 25) -> dict[str, Any]:
    """Self CPU time by operator over ``steps`` calls of ``run`` (after one untimed call), per call."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"per_call_ms": total / 1000 / steps,
            "ops": [{"op": e.key, "self_ms_per_call": e.self_cpu_time_total / 1000 / steps, "calls_per_call": e.count / steps,
                     "share": e.self_cpu_time_total / total} for e in events[:top]]}  # fmt: skip


def profiles(model: Any, tokenizer: Any, context: int, batch: int) -> dict[str, Any]:
    """Operator profiles of a one-token target forward at B = 1 (our engine's cached forward) and B (the
    batched engine's masked forward), and of ``generate``'s decoding (per new token, its prefill left out)."""
    from mars_bench.models.kvcache import batch_forward, crop_batch

    vocab = model.config.vocab_size
    draw = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (context + 1,), generator=draw)
    cache = new_cache(model)
    cached_logits(model, ids[:context], cache, last_only=True)

    def one_row() -> None:
        crop_to(cache, context)
        cached_logits(model, ids[context:], cache)

    rows = torch.randint(0, vocab, (batch, context), generator=draw)
    batch_cache = new_cache(model)
    no_cache = torch.zeros(batch, 0, dtype=torch.bool)
    _, attended = batch_forward(model, batch_cache, no_cache, rows, torch.ones_like(rows, dtype=torch.bool), 1)
    new = torch.randint(0, vocab, (batch, 1), generator=draw)

    def many_rows() -> None:
        batch_forward(model, batch_cache, attended, new, torch.ones_like(new, dtype=torch.bool))
        crop_batch(batch_cache, attended, context)

    prompt = torch.randint(0, vocab, (1, context), generator=draw)
    new_tokens = 16

    def generate() -> None:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=tokenizer.eos_token_id or 0)  # fmt: skip

    out = {"ours_b1_w1": op_profile(one_row, 10), f"ours_b{batch}_w1": op_profile(many_rows, 10)}
    whole = op_profile(generate, 2, top=40)
    out["generate_16_tokens_with_prefill"] = whole
    return out


def machine_limits(dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """What this machine reaches outside any model: GB/s reading 1 GiB of memory (a float32 sum over it), and
    GFLOP/s of a large ``dtype`` matrix product (2048 x 2048 x 2048, the matrix units' reach); medians of
    ``repeats``."""
    data = torch.ones(2**28, dtype=torch.float32)
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    read, multiply = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.mm(a, b)
        multiply.append(time.perf_counter() - start)
    return {"read_gb_s": 2**30 / statistics.median(read[1:]) / 1e9,
            "gemm_gflop_s": 2 * 2048**3 / statistics.median(multiply[1:]) / 1e9}


def bf16_step(value: float) -> float:
    """The spacing of bfloat16 numbers at ``value`` (8 significant bits): one bf16 step there."""
    exponent = torch.frexp(torch.tensor(abs(value) or 1e-30, dtype=torch.float32)).exponent.item()
    return 2.0 ** (exponent - 8)


@torch.inference_mode()
def divergences(target: Any, prompts: list[list[int]], new_tokens: int, stops: list[int]) -> list[dict[str, Any]]:
    """Our AR decode of each prompt on ``target`` as loaded against transformers' ``generate`` on a stock load
    of the same weights (``peer.load_peer``), greedy. Where they part, the stock model's logits at that
    position: the gap between its top token (generate's) and ours, and one bf16 step at its top logit."""
    from mars_bench.decoding import decode
    from mars_bench.perf.peer import load_peer, peer_generate, peer_generation_config

    stock = load_peer(target.resolved.path, target.dtype)
    config = peer_generation_config(new_tokens, 0.0, stops, stops[0])
    rows = []
    for index, prompt in enumerate(prompts):
        ours = decode(target.model, None, None, prompt, max_new_tokens=new_tokens, stop_token_ids=stops).tokens
        theirs = peer_generate(stock, prompt, config)
        row: dict[str, Any] = {"prompt": index, "tokens": len(ours), "identical": ours == theirs, "first_divergence": None}
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if at is not None:
            logits = stock(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
            top = logits[theirs[at]].item()
            row["first_divergence"] = {"position": at, "generate_token": theirs[at], "our_token": ours[at],
                                       "logit_gap": top - logits[ours[at]].item(), "bf16_step": bf16_step(top)}  # fmt: skip
        rows.append(row)
        print("divergence", json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="+", default=["stock", "onednn1", "onednn16", "onednn32"])
    parser.add_argument("--drafter-weights", nargs="*", default=["int4", "int8"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=147)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--widths", type=int, nargs="*", default=[], help="also time the target at B = 1 over these widths")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-candidates", nargs="+", default=["stock", "onednn16"])
    parser.add_argument("--equality", type=int, default=0, metavar="N",
                        help="also decode N HumanEval prompts with our AR on packed layers and with generate on a stock load")
    parser.add_argument("--equality-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("forward_kernels_out"))
    parser.add_argument("--skip-limits", action="store_true",
                        help="leave out the machine's limits (an emulated bf16 product takes minutes)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    limits = {} if args.skip_limits else machine_limits(getattr(torch, args.dtype))
    print("limits", json.dumps(limits), flush=True)
    target = load_model(TARGET, dtype=args.dtype, kernels="stock")
    draft = load_model(DRAFT, dtype=args.dtype, kernels="stock")
    report: dict[str, Any] = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "started": started, "args": {k: str(v) for k, v in vars(args).items()}, "seconds": {},
                              "env": {name: os.environ.get(name) for name in AFFINITY_ENV},
                              "setup_s": {}, "profiles": {}, "limits": limits}  # fmt: skip

    def record(candidate: str, seconds: dict[str, float]) -> None:
        report["seconds"].setdefault(candidate, {}).update(seconds)
        print(candidate, json.dumps({k: round(v * 1000, 1) for k, v in seconds.items()}), "ms", flush=True)

    for candidate in args.candidates:
        models = {"target": target.model, "drafter": draft.model}
        setup = time.perf_counter()
        if candidate.startswith("onednn"):
            hint = int(candidate.removeprefix("onednn") or PACK_BATCH_HINT)
            packs = {name: pack_linears(model, hint).describe() for name, model in models.items()}
            report.setdefault("packed", {})[candidate] = packs
        elif candidate == "compile":
            import torch._inductor.config as inductor

            inductor.freezing = True
            models = {name: torch.compile(model, dynamic=True) for name, model in models.items()}
        report["setup_s"][candidate] = time.perf_counter() - setup
        first = time.perf_counter()
        for name, model in models.items():
            record(candidate, model_cases(model, name, args.context, args.repeats, args.batch))
        if args.widths:
            record(candidate, {f"target_b1_w{width}": forward_seconds(models["target"], args.context, width, args.repeats)
                               for width in args.widths})  # fmt: skip
        report["setup_s"][candidate + "_first_timed_pass"] = time.perf_counter() - first
        if args.profile and candidate in args.profile_candidates:
            report["profiles"][candidate] = profiles(models["target"], target.tokenizer, args.context, args.batch)
            step = functools.partial(drafter_step, models["drafter"], args.context)
            report["profiles"][candidate]["drafter_w1"] = op_profile(step, 10)
        if candidate.startswith("onednn"):
            for model in models.values():
                unpack_linears(model)
        elif candidate == "compile":
            torch._dynamo.reset()
    for weights in args.drafter_weights:
        quantized = quantized_draft_model(draft.model, weights)
        record(f"drafter_{weights}", model_cases(quantized, "drafter", args.context, args.repeats, args.batch))
    if args.equality:
        from mars_bench.models.loading import stop_token_ids
        from mars_bench.perf.suite import first_turn_prompts

        report["packed_for_equality"] = pack_linears(target.model).describe()
        prompts = first_turn_prompts(target.tokenizer, "humaneval", args.equality)
        report["divergences"] = divergences(target, prompts, args.equality_tokens, stop_token_ids(target))
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"cpu: {report['cpu']}; written {args.out / 'results.json'}")


_DRAFT_CACHES: dict[int, Any] = {}


@torch.inference_mode()
def drafter_step(model: Any, context: int) -> None:
    """One one-token drafter forward after ``context`` cached positions (the cache made once per model)."""
    if id(model) not in _DRAFT_CACHES:
        ids = torch.randint(0, model.config.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(2))
        cache = new_cache(model)
        cached_logits(model, ids[:context], cache, last_only=True)
        _DRAFT_CACHES[id(model)] = (cache, ids)
    cache, ids = _DRAFT_CACHES[id(model)]
    crop_to(cache, context)
    cached_logits(model, ids[context:], cache)


if __name__ == "__main__":
    main()
