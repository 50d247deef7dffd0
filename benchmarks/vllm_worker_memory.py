"""The resident memory of ``backend=vllm``'s workers: each engine loaded alone, a long prefill, a few tokens.

    python benchmarks/vllm_worker_memory.py [--target ID] [--draft ID] [--dtype float32] [--out FILE]

For the baseline's engine (the target alone) and the method's (the target with its draft model, gamma 5, MARS
judging through the plugin), the worker's peak resident memory sampled every 0.2 s from ``/proc/<pid>/status``
(``RssAnon``: what it allocated; ``RssFile``: mapped checkpoint pages, which the kernel can drop), beside what the
memory plan (``backends/vllm_memory.py``) counts for it: weights at the dtype, KV space, the worker's own share.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from tempfile import mkdtemp

from mars_bench.backends import vllm_memory
from mars_bench.backends.vllm import MAX_MODEL_LEN, VllmWorker, draft_model_config
from mars_bench.models.sources import resolve_model
from mars_bench.serving.install import vllm_python

FIELDS = ("VmRSS", "RssAnon", "RssFile")


def peak_while(pid: int, work) -> dict[str, float]:
    """GiB: the largest value of each of ``FIELDS`` for process ``pid`` while ``work()`` runs."""
    peak, done = dict.fromkeys(FIELDS, 0), threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    key = line.split(":")[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]) * 1024)
            except OSError:
                pass
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        work()
    finally:
        done.set()
        watcher.join()
    return {key: round(value / vllm_memory.GIB, 2) for key, value in peak.items()}


def measure(label: str, target: Path, draft: Path | None, dtype: str, kv_gib: int) -> dict:
    folders = [target, *([draft] if draft else [])]
    weights = vllm_memory.weight_bytes(folders, dtype)
    verifier = {"name": "mars", "settings": {}} if draft else None
    worker = VllmWorker(vllm_python(), verifier, Path(mkdtemp()), label, {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)})

    def work() -> None:
        worker.ask({"op": "load", "model": str(target), "dtype": dtype, "seed": 0, "max_model_len": MAX_MODEL_LEN,
                    "max_num_seqs": 1, "speculative_config": draft_model_config(str(draft), 5) if draft else None})
        worker.ask({"op": "generate", "prompts": [[1, 2, 3] * 600], "seeds": [0], "max_new_tokens": 16,
                    "stop_token_ids": [], "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0}})

    try:
        peak = peak_while(worker.process.pid, work)
    finally:
        worker.close()
    gib = lambda size: round(size / vllm_memory.GIB, 2)  # noqa: E731
    own = peak["RssAnon"] - gib(weights) - kv_gib
    return {"engine": label, "dtype": dtype, "weights_gib": gib(weights), "kv_gib": kv_gib, "peak_gib": peak,
            "own_gib": round(own, 2), "planned_own_gib": gib(vllm_memory.worker_overhead(weights))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    parser.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    target, draft = Path(resolve_model(args.target).path), Path(resolve_model(args.draft).path)
    found = [measure("baseline", target, None, args.dtype, args.kv_gib), measure("mars", target, draft, args.dtype, args.kv_gib)]
    text = json.dumps(found, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
