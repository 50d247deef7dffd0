"""``backend=vllm``: the baseline and the method run in vLLM's offline engine, and the method's verifier
(one of this package's) decides acceptance inside it through the plugin (``serving/vllm_plugin.py``).

vLLM pins another transformers than this package, so it lives in an environment of its own
(``python -m mars_bench.serving.install`` makes it). Each prepared method gets a worker process in that
environment (``serving/vllm_worker.py``) holding one ``vllm.LLM``: without speculation for the baseline,
with it for the method. This process keeps the tokenizer, the records and everything else.

Drafters: ``model`` is vLLM's ``draft_model`` (the model's ``draft_model``), ``lookup`` its ``ngram``
(``min_ngram``/``max_ngram``), ``eagle3`` its ``eagle3`` with the model's ``eagle3_head``; ``gamma`` is
``num_speculative_tokens`` (fixed: vLLM drafts a fixed count).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from mars_bench.backends import vllm_memory, vllm_placement
from mars_bench.backends.base import Backend, EngineStopped, MethodsPlan, PreparedMethod, Requests
from mars_bench.backends.vllm_memory import GIB, EngineFigures, MemoryFigures, MemoryPlan, OomWitness, gib
from mars_bench.backends.vllm_placement import GpuFigures
from mars_bench.common import engine_processes
from mars_bench.common.kernels import DEFAULT_KERNELS
from mars_bench.decoding.fidelity import PositionCosts
from mars_bench.decoding.trace import DecodeResult, StepRecord
from mars_bench.method import MethodSpec
from mars_bench.models.loading import stop_tokens_of
from mars_bench.models.sources import resolve_model
from mars_bench.serving.install import COMMAND, CPU_PACKAGE, PYTHON_ENV, installed_vllm, installed_vllm_dist, vllm_python
from mars_bench.serving.vllm_versions import hooks_of, supported_range

DRAFTERS = {"model": "draft_model", "lookup": "ngram", "eagle3": "eagle3"}  # ours -> vLLM's method
MAPPED_SETTINGS = {"lookup": ("min_ngram", "max_ngram")}  # drafter settings vLLM takes (speculative_config)
MAX_MODEL_LEN = 4096  # prompt and answer, in tokens: what vLLM sizes its KV cache for
KV_CACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE of each engine (GiB) where the environment sets none
WORKER_MODULE = "mars_bench.serving.vllm_worker"


def check_vllm_config(cfg: Any, spec: MethodSpec) -> None:
    """Refuse, in one line and before any model loads, what ``backend=vllm`` cannot run (``spec``: the cell's method):
    every key at once, with the one override that runs. (A drafter tuning does not reach here: it is measured in this
    package's engine, and ``config.take_back_tuning`` takes it back for vLLM.)"""
    from mars_bench.common.settings import cli_value
    from mars_bench.drafting import build_settings

    drafter = cfg.drafter.name
    if drafter not in (*DRAFTERS, "none"):
        raise ValueError(f"drafter={drafter} does not run in vLLM: allowed with backend=vllm are {', '.join(DRAFTERS)}")
    refused, allowed = [], []
    if drafter != "none" and cfg.drafter.length != "fixed":
        refused.append(f"drafter.length={cfg.drafter.length} does not run in vLLM, which drafts gamma tokens a step")
        allowed.append("drafter.length=fixed")
    settings, defaults = spec.drafter_settings, build_settings(drafter)
    unmapped = [item.name for item in dataclasses.fields(settings) if item.name not in MAPPED_SETTINGS.get(drafter, ())]
    if changed := [key for key in unmapped if getattr(settings, key) != getattr(defaults, key)]:
        named = ", ".join(f"drafter.{key}={cli_value(getattr(settings, key))}" for key in changed)
        refused.append(f"{named} {'is not a setting' if len(changed) == 1 else 'are not settings'} of vLLM's drafter")
        allowed += [f"drafter.{key}={cli_value(getattr(defaults, key))}" for key in changed]
    kernels = getattr(cfg.model, "kernels", DEFAULT_KERNELS)
    if kernels != DEFAULT_KERNELS:
        refused.append(f"model.kernels={kernels} chooses the linear layers of this package's engine; vLLM runs its own")
        allowed.append(f"model.kernels={DEFAULT_KERNELS}")
    if refused:
        raise ValueError(f"{'; '.join(refused)}: allowed with backend=vllm is {' '.join(allowed)}")
    check_vllm_installed("backend=vllm")
    check_gpu_settings(cfg, spec)


def check_gpu_settings(cfg: Any, spec: MethodSpec) -> None:
    """Refuse, in one line and before any model loads, ``vllm.tensor_parallel_size`` > 1 on vLLM's CPU build, and,
    on a GPU build where a GPU memory figure is known (``vllm.gpu_memory_gb``, or GPUs this process sees), an engine
    that does not fit its GPUs (``gpu_placement``). vLLM's environment is probed only where one of those is set."""
    settings = cfg.vllm
    tp = settings.tensor_parallel_size
    if tp == 1 and settings.gpu_memory_gb is None and not vllm_placement.visible_gpus():
        return
    python = vllm_python()
    if not vllm_on_cpu(python):
        gpu_placement(cfg, spec)
    elif tp > 1:
        raise ValueError(f"vllm.tensor_parallel_size={tp} shards an engine over GPUs, and the vLLM at {python} is its CPU "
                         f"build ({CPU_PACKAGE}), one process on the CPU: allowed with it is vllm.tensor_parallel_size=1 "
                         "(GPUs: the official vllm, docs/vllm.md#on-gpus)")  # fmt: skip


def gpu_settings(cfg: Any) -> dict[str, Any]:
    """The ``vllm.*`` settings the worker passes to ``vllm.LLM`` (their defaults are vLLM's own, so an engine built
    with them is built as without them)."""
    return {key: cfg.vllm[key] for key in ("tensor_parallel_size", "gpu_memory_utilization")}


def gpu_placement(cfg: Any, spec: MethodSpec) -> str:
    """The line of the GPU plan (``vllm_placement.plan_gpus``) of the engine of ``spec``, from the models' configs
    (no weights: a Hub id's config.json alone, ``placement.config_before_weights``) and the memory of each GPU
    (``vllm.gpu_memory_gb``, else the smallest of the first ``vllm.tensor_parallel_size`` GPUs this process sees);
    ValueError, in one line, where it does not fit or fewer GPUs are seen. A line saying why where no plan can be
    made (no GPU memory figure, a config that cannot be read before loading)."""
    from mars_bench.models import placement

    settings = cfg.vllm
    tp = settings.tensor_parallel_size
    if settings.gpu_memory_gb is not None:
        memory = int(settings.gpu_memory_gb * GIB)
    elif gpus := vllm_placement.visible_gpus():
        if len(gpus) < tp:
            raise ValueError(f"vllm.tensor_parallel_size={tp} needs {tp} GPUs, and this process sees {len(gpus)}: allowed "
                             f"is a vllm.tensor_parallel_size up to {len(gpus)}, or more GPUs visible (CUDA_VISIBLE_DEVICES)")
        memory = min(gpus[:tp])
    else:
        return "vLLM on GPUs: not planned, as this process sees no CUDA GPU (vllm.gpu_memory_gb=<GiB per GPU> plans for one)"
    method = DRAFTERS.get(spec.drafter) if spec.drafts else None
    checkpoints = [(cfg.model.target, False)] + {"eagle3": [(cfg.model.eagle3_head, True)],
                                                  "draft_model": [(cfg.model.draft_model, False)]}.get(method, [])  # fmt: skip
    models = []
    for name, eagle3_head in checkpoints:
        config = placement.config_before_weights(name)
        if config is None:
            return f"vLLM on GPUs: not planned, as the config of {name} could not be read before loading"
        size = vllm_placement.head_figures if eagle3_head else vllm_placement.model_figures
        models.append(size(name, config.to_dict() if eagle3_head else config, cfg.model.dtype))
    figures = GpuFigures(models[0], models[1] if len(models) > 1 else None, tp, settings.gpu_memory_utilization, memory,
                         MAX_MODEL_LEN, cfg.model.dtype)  # fmt: skip
    return vllm_placement.plan_gpus(figures).line


def check_vllm_installed(asker: str) -> None:
    """ValueError, in one line naming ``asker`` (what needs vLLM), unless vLLM's environment holds a supported vLLM."""
    python = vllm_python()
    version = installed_vllm(python)
    if version is None:
        raise ValueError(f"{asker} needs vLLM, which {python} does not have: install it with `{COMMAND}` "
                         f"(or set {PYTHON_ENV} to a Python with vLLM {supported_range()} and mars_bench)")  # fmt: skip
    try:
        hooks_of(version)
    except ValueError as error:
        raise ValueError(f"{error} (at {python}; {asker})") from None


def draft_model_config(draft_path: str, gamma: int) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for its draft-model speculation: ``gamma`` drafts a step from the draft
    checkpoint at ``draft_path``."""
    return {"method": DRAFTERS["model"], "model": draft_path, "num_speculative_tokens": gamma}


def speculative_config(spec: MethodSpec, cfg: Any) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for the method (None for the baseline)."""
    if not spec.drafts:
        return None
    method = DRAFTERS[spec.drafter]
    if method == DRAFTERS["model"]:
        return draft_model_config(str(resolve_model(cfg.model.draft_model).path), spec.length.gamma)
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": spec.length.gamma}
    if method == "eagle3":
        config["model"] = str(resolve_model(cfg.model.eagle3_head).path)
    else:
        config["prompt_lookup_min"] = spec.drafter_settings.min_ngram
        config["prompt_lookup_max"] = spec.drafter_settings.max_ngram
    return config


def vllm_on_cpu(python: Path) -> bool:
    """Whether ``python``'s vLLM runs on the CPU: its distribution is the CPU build (``CPU_PACKAGE``) or its version a
    ``+cpu`` build; where neither can be read, whether this process sees no GPU."""
    found = installed_vllm_dist(python)
    if found is None:
        import torch

        return not torch.cuda.is_available()
    name, version = found
    return name == CPU_PACKAGE or version.endswith("+cpu")


def engine_folders(cfg: Any, spec: MethodSpec) -> list[Path]:
    """The checkpoints the engine of ``spec`` loads: the target, and the method's draft model or EAGLE head."""
    drafter = speculative_config(spec, cfg) or {}
    return [Path(resolve_model(cfg.model.target).path), *([Path(drafter["model"])] if "model" in drafter else [])]


def memory_plan(cfg: Any, methods: Mapping[str, MethodSpec]) -> MemoryPlan:
    """The plan (``vllm_memory.plan_memory``) of one engine per method (label -> spec, in the order they would
    run one at a time) on this machine, now; ValueError, in one line, where not even one engine fits. On a GPU its
    line ends with the GPU plan's of the largest engine (``gpu_placement``)."""
    on_cpu = vllm_on_cpu(vllm_python())
    kv = vllm_memory.kv_space(os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)) if on_cpu else 0
    weights = {label: vllm_memory.weight_bytes(engine_folders(cfg, spec), cfg.model.dtype) if on_cpu else 0
               for label, spec in methods.items()}  # fmt: skip
    engines = tuple(EngineFigures(label, size, kv, vllm_memory.worker_overhead(size)) for label, size in weights.items())
    figures = MemoryFigures(engines, vllm_memory.available_memory(), vllm_memory.HARNESS_MARGIN, cfg.model.dtype, on_cpu)
    plan = vllm_memory.plan_memory(figures)
    if on_cpu:
        return plan
    largest = next((spec for spec in methods.values() if spec.drafts), next(iter(methods.values())))
    return MemoryPlan(plan.together, f"{plan.line}; {gpu_placement(cfg, largest)}")


def how_it_ended(returncode: int | None) -> str:
    """A process's end from its ``Popen.returncode``: the signal that killed it, by name, or its exit code."""
    if returncode is None:
        return "ended"
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


def last_line(path: Path, tail: int = 4096) -> str | None:
    """The last non-empty line of the file at ``path`` (read from its last ``tail`` bytes), None where none."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(handle.seek(0, os.SEEK_END) - tail, 0))
            lines = [line.strip() for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


class VllmWorker:
    """One worker process in vLLM's environment, speaking JSON lines (``serving/vllm_worker.py``)."""

    def __init__(self, python: Path, verifier: dict[str, Any] | None, folder: Path, label: str,
                 extra_env: dict[str, str] | None = None, command: Sequence[str] | None = None) -> None:  # fmt: skip
        """``command``: what starts the worker, ``--reply-fd N`` after it (default ``python -m WORKER_MODULE``;
        the tests' stand-in speaks the same protocol)."""
        self.label = label
        self.log = folder / f"{label}.log"
        self.trace = folder / f"{label}.trace.jsonl"
        source = str(Path(__file__).resolve().parents[2])  # this package's copy, whatever the environment holds
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "MARS_BENCH_VLLM_TRACE": str(self.trace),
               "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if verifier is not None:
            env["MARS_BENCH_VLLM_VERIFIER"] = json.dumps(verifier)
        env.update(extra_env or {})
        self.witness = OomWitness.now()  # what the kernel had said of the OOM killer before this worker ran
        read, write = os.pipe()
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [*(command or (str(python), "-m", WORKER_MODULE)), "--reply-fd", str(write)],
                stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write,), env=env, text=True,
            )  # fmt: skip
        engine_processes.adopt(self.process.pid)  # its CPU time is this run's work, not another process's
        os.close(write)
        self.replies = os.fdopen(read)

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer to ``message``: RuntimeError, in one line, for a failure it reports;
        ``EngineStopped``, in one line saying how it died, where it died before answering."""
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = self.reply()
        except BrokenPipeError:  # it had died before it could read the message
            line = ""
        if not line.endswith("\n"):  # nothing, or a line cut short: it died before it had answered whole
            raise EngineStopped(self.death(message.get("op")))
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM: {answer['error']} (see {self.log})")
        return answer

    def reply(self) -> str:
        """The worker's next line, or "" once it has ended: a process it started may hold the pipe open after it died,
        so its end is looked for each second (without reaping it: ``reap`` reads its peak memory)."""
        while not select.select([self.replies], [], [], 1.0)[0]:
            try:
                if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return ""
            except ChildProcessError:  # reaped already
                return ""
        return self.replies.readline()

    def reap(self, timeout: float = 10.0) -> tuple[int | None, int | None]:
        """The return code of the worker, which has stopped answering (``Popen.returncode``: minus the signal that
        killed it), and its peak resident bytes as the kernel counts them (None where it was reaped before); a worker
        that has not ended within ``timeout`` seconds is killed (it answers no more, and may hold an engine's memory)."""
        deadline = time.monotonic() + timeout
        while self.process.returncode is None:
            try:
                pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: Popen knows how it ended
                self.process.poll()
                break
            if pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                return self.process.returncode, usage.ru_maxrss * 1024  # Linux counts it in KiB
            if time.monotonic() > deadline:
                self.process.kill()
                deadline = math.inf
            time.sleep(0.05)
        return self.process.returncode, None

    def death(self, op: str | None) -> str:
        """How the worker died, in one line: its exit code or the signal that killed it, its peak memory, whether
        the OOM killer killed it (where the kernel says), the last line of its log where it exited, and the log."""
        returncode, peak = self.reap()
        doing = {"load": " while it loaded its engine", "generate": " during a generate call"}.get(op or "", "")
        line = f"the vLLM worker of {self.label} {how_it_ended(returncode)}{doing}"
        # A child's peak counts its parent's image it was forked (vforked) from until it exec'd: above this
        # process's own peak, it is the worker's own.
        if peak and peak > resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024:
            line += f", at a peak of {gib(peak)} resident"
        if returncode == -signal.SIGKILL:
            line += f" ({self.witness.verdict(OomWitness.now(), self.process.pid)})"
        elif (ending := last_line(self.log)) is not None:
            line += f" (its log ends: {ending})"
        return f"{line}; its log: {self.log}"

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        try:
            self.process.stdin.close()
        except OSError:  # a dead worker's pipe, with a message still buffered for it
            pass
        self.replies.close()
        engine_processes.release(self.process.pid)


def by_name(verifier: Any) -> dict[str, Any]:
    """A verifier as the plugin rebuilds it: its name and its settings (those its description carries)."""
    described = verifier.describe()
    return {"name": described.pop("name"), "settings": described}


def step_record(step: dict[str, Any]) -> StepRecord:
    """One traced step of a request (``vllm_worker.steps_by_request``) as our engine records it: with fidelity
    on, the live verifier's costs then each shadow's (None without drafts) and their seconds."""
    costs = step.get("fidelity")
    nan = lambda values: [math.nan if value is None else value for value in values]  # noqa: E731  (JSON's None)
    return StepRecord(drafted=step["drafted"], accepted=step["accepted"], relaxed=step["relaxed"], next_token=step["next"],
                      emitted=step["accepted"] + 1, reasons=step["reasons"], flags=step.get("flags", {}),
                      values={name: nan(found) for name, found in step.get("values", {}).items()},
                      shadow_accepted=step.get("shadow_accepted", []),
                      fidelity=None if costs is None else [PositionCosts(**cost) for cost in costs],
                      fidelity_s=step.get("fidelity_s", 0.0))  # fmt: skip


def decode_result(result: dict[str, Any], prompt_len: int, stops: tuple[int, ...]) -> DecodeResult:
    """A ``DecodeResult`` from one request's worker answer: its tokens, the engine's timestamps and its steps
    after the prefill's. prefill: from the request's arrival (the ``generate`` call) to its first token, its
    wait for a free slot included; decode: first to last token. So prefill + decode is when the request
    finished after the call began, as the batched engine's rows count it. The seconds the plugin spent aside
    meanwhile (shadows, fidelity: ``aside_s``, before and after the first token) are left out, as our engine
    leaves them out of the method's time. engine_step_s and engine_step_rows: each engine step that served the
    request after its prefill (``vllm_worker.EngineSteps``), its seconds less the plugin's aside in it, and the
    requests it served; a traced step is one engine step, so with speculation the two lists align."""
    steps = [step_record(step) for step in result["steps"][1:]]
    tokens = result["tokens"]
    emitted = len(tokens) - 1  # the prefill's token first; budgets and stops cut the last step's emission
    for step in steps:
        step.emitted = min(step.emitted, max(emitted, 0))
        emitted -= step.emitted
    if result["finish"] == "length":
        reason = "max_new_tokens"
    else:
        reason = "stop_token" if tokens and tokens[-1] in stops else "stop_string"
    prefill_aside, decode_aside = result.get("aside_s", (0.0, 0.0))
    engine_steps, traced = result.get("engine_steps", [])[1:], result["steps"][1:]  # each after the prefill's
    aside = [step.get("aside_s", 0.0) for step in traced] if traced and engine_steps else [0.0] * len(engine_steps)
    return DecodeResult(prompt_len, tokens, steps, prefill_s=max(result["first_token"] - result["queued"] - prefill_aside, 0.0),
                        decode_s=max(result["last_token"] - result["first_token"] - decode_aside, 0.0),
                        stop_reason=reason, engine_step_s=[max(seconds - away, 0.0) for (_, seconds), away in
                                                           zip(engine_steps, aside, strict=True)],
                        engine_step_rows=[rows for rows, _ in engine_steps])  # fmt: skip


def check_counters(answer: dict[str, Any]) -> None:
    """RuntimeError unless the plugin's trace of a ``generate`` call (every request's steps after its prefill)
    adds up to what vLLM's own spec-decode counters counted in it: steps that drafted, drafts, kept drafts."""
    steps = [step for result in answer["results"] for step in result["steps"][1:]]
    traced = {"num_drafts": sum(1 for step in steps if step["drafted"]), "num_draft_tokens": sum(s["drafted"] for s in steps),
              "num_accepted_tokens": sum(step["accepted"] for step in steps)}  # fmt: skip
    counted = {name: answer["counters"][name] for name in traced}
    if traced != counted:
        raise RuntimeError(f"the plugin's trace ({traced}) differs from vLLM's spec-decode counters ({counted})")


class VllmBackend(Backend):
    """vLLM's offline engine on the cell's target, one worker per method (see the module)."""

    name: ClassVar[str] = "vllm"
    serves_a_queue: ClassVar[bool] = True
    own_engine: ClassVar[bool] = False  # its steps are vLLM's: priced by their own times (engine_step_s)

    def __init__(self, cfg: Any) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.target = resolve_model(cfg.model.target)
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.target.path))
        self.folder = Path(tempfile.mkdtemp(prefix="mars_bench_vllm_"))
        self.workers: list[VllmWorker] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        config = Path(self.target.path) / "generation_config.json"
        eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
        return tuple(stop_tokens_of(self._tokenizer, eos))

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cpu")  # vLLM's memory is its own process's: this one's peak says nothing of it

    def models(self) -> dict[str, Any]:
        return {}

    def prepare(self, label: str, spec: MethodSpec) -> PreparedMethod:
        worker = VllmWorker(vllm_python(), None if spec.verifier is None else by_name(spec.build_verifier()), self.folder, label)
        self.workers.append(worker)
        m = self.cfg.model
        worker.ask({"op": "load", "model": str(self.target.path), "dtype": m.dtype, "seed": self.cfg.seed,
                    "max_model_len": MAX_MODEL_LEN, "max_num_seqs": max(self.cfg.batch_size, 1),
                    "speculative_config": speculative_config(spec, self.cfg), **gpu_settings(self.cfg)})  # fmt: skip
        return PreparedMethod(label, spec, worker)

    def describe(self, method: PreparedMethod) -> dict[str, Any]:
        spec = method.spec
        return {"drafter": speculative_config(spec, self.cfg),
                "verifier": None if spec.verifier is None else spec.build_verifier().describe()}  # fmt: skip

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        sampling = method.spec.sampling
        stop_strings = list(getattr(requests.stop_when, "strings", ()) or ())
        answer = method.handle.ask({
            "op": "generate", "prompts": [list(p) for p in requests.prompts], "seeds": list(requests.seeds),
            "max_new_tokens": requests.max_new_tokens, "stop_token_ids": list(requests.stop_token_ids),
            "stop": stop_strings, "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                               "top_k": sampling.top_k},
            "shadows": [by_name(shadow) for shadow in requests.shadows] if method.judged else [],
            "fidelity": requests.fidelity and method.judged,
        })  # fmt: skip
        if answer["counters"] is not None:
            check_counters(answer)
        return [decode_result(result, len(prompt), tuple(requests.stop_token_ids))
                for result, prompt in zip(answer["results"], requests.prompts)]  # fmt: skip

    def plan_methods(self, methods: Mapping[str, MethodSpec]) -> MethodsPlan:
        """Whether one engine per method fits in memory beside the others (``memory_plan``)."""
        plan = memory_plan(self.cfg, methods)
        return MethodsPlan(plan.together, plan.line)

    def release(self, method: PreparedMethod) -> None:
        """Stop ``method``'s worker, freeing its engine's memory for the next method's."""
        method.handle.close()
        self.workers.remove(method.handle)

    def close(self) -> None:
        """Stop every worker (each holds an engine with its model and KV cache)."""
        for worker in self.workers:
            worker.close()
        self.workers.clear()
