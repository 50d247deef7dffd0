"""vLLM's CPU engine as a peer of the perf suite: its autoregressive decoding and its own draft-model
speculative decoding, on the target and draft checkpoints our side loads, in the same dtype.

vLLM is run as its users run it: ``vllm.LLM`` with its own acceptance rule (no verifier of this package is
installed: the plugin stays out), ``enforce_eager=True`` as on the CPU figures this suite is compared with,
one request at a time (``max_num_seqs=1``, the suite times batch 1). It lives in its own environment
(``python -m mars_bench.serving.install``), one worker process per engine (``backends.vllm.VllmWorker``).
Both engines stay loaded for the whole run, beside our models and transformers', so each gets a KV cache of
``KV_CACHE_GB`` (one request of ``MAX_MODEL_LEN`` tokens needs far less) instead of the backend's 4 GB; they
start before our models load, so that ``model.kernels=auto`` packs ours only where the copies still fit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from mars_bench.backends.vllm import MAX_MODEL_LEN, VllmWorker, check_vllm_installed, draft_model_config
from mars_bench.serving.install import vllm_python

VLLM_PEERS = ("vllm", "vllm-spec")  # --peers: vLLM's AR, and its draft-model speculative decoding
KV_CACHE_GB = "1"  # VLLM_CPU_KVCACHE_SPACE of each engine the suite holds
ENFORCE_EAGER = True


def check_vllm_peers(peers: tuple[str, ...]) -> None:
    """ValueError, in one line, where ``peers`` names a vLLM peer and vLLM's environment lacks the tested vLLM."""
    asked = [peer for peer in peers if peer in VLLM_PEERS]
    if asked:
        check_vllm_installed(f"--peers {' '.join(asked)}")


class VllmEngines:
    """The vLLM engines a suite times: ``"vllm"`` without speculation, ``"vllm-spec"`` with it."""

    def __init__(self, peers: tuple[str, ...], target_path: str, draft_path: str, dtype: str, gamma: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="mars_bench_perf_vllm_"))
        self.loading: dict[str, dict[str, Any]] = {}
        self.engines: dict[str, VllmWorker] = {}
        try:
            for peer in (peer for peer in VLLM_PEERS if peer in peers):
                spec = draft_model_config(draft_path, gamma) if peer == "vllm-spec" else None
                load = {"op": "load", "model": target_path, "dtype": dtype, "seed": 0, "max_model_len": MAX_MODEL_LEN,
                        "max_num_seqs": 1, "enforce_eager": ENFORCE_EAGER, "speculative_config": spec}  # fmt: skip
                worker = VllmWorker(vllm_python(), None, self.folder, peer, {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GB})
                self.engines[peer] = worker
                answer = worker.ask(load)
                self.loading[peer] = {**{k: v for k, v in load.items() if k != "op"}, "kv_cache_gb": float(KV_CACHE_GB),
                                      "vllm": answer["vllm"], "load_s": answer["load_s"]}  # fmt: skip
        except BaseException:
            self.close()
            raise

    def generate(self, peer: str, prompt: list[int], max_new_tokens: int, stops: list[int], seed: int) -> dict[str, Any]:
        """One greedy request: its new tokens and, with speculation, vLLM's spec-decode counters for it."""
        answer = self.engines[peer].ask({
            "op": "generate", "prompts": [prompt], "seeds": [seed], "max_new_tokens": max_new_tokens,
            "stop_token_ids": stops, "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
        })  # fmt: skip
        return {"tokens": answer["results"][0]["tokens"], "counters": answer["counters"]}

    def close(self) -> None:
        for worker in self.engines.values():
            worker.close()
        self.engines.clear()
