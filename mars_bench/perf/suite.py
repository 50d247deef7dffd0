"""The timed comparisons. Every number comes from wall-clock time around one whole decode
call (ours or transformers'), in one process, on the same prompts, with the order of the
methods rotating per prompt and per repeat.

Methods, at each temperature asked for: our autoregressive baseline; transformers' plain
``generate`` (greedy only) and assisted generation, on models loaded exactly as a
transformers user loads them (``peer.load_peer``); where asked for (greedy only), vLLM's CPU engine
without and with its own draft-model speculative decoding (``vllm_peer``); our chain speculative
decoding in each drafter configuration (a draft-length policy and the drafter's own settings), with
``exact`` when greedy and ``rejection`` when sampling.

Our methods are ``MethodSpec``s, named and set as the app names and sets them (the drafter registry's
``drafter_settings``, the verifier registry), and run through the backend seam a sweep cell runs them through
(``mars_bench/backends``): the backend is built from the app's run config (``backend_config``) with the models a
cell loads, and each method is prepared on it and decoded by its ``generate``. The peers run as their users run them.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from mars_bench.backends import PreparedMethod, Requests, make_backend
from mars_bench.backends.base import backend_class, check_backend
from mars_bench.bench.contention import ContentionMeter
from mars_bench.bench.manifest import cpu_description, git_state, gpu_description, package_versions, source_hash
from mars_bench.common.kernels import DEFAULT_KERNELS, check_kernels
from mars_bench.common.strict_rule import strict_verifier
from mars_bench.common.token_counts import emitted_tokens
from mars_bench.config.backend import backend_config
from mars_bench.config.schema import ModelConfig
from mars_bench.decoding.draft_length import DEFAULT_LENGTH, DraftLengthSettings
from mars_bench.decoding.engine import cut_at_stop
from mars_bench.decoding.trace import PHASES
from mars_bench.drafting import available_drafters, build_settings, drafter_needs_model, is_tree_drafter
from mars_bench.drafting.draft_vocab import check_count_file
from mars_bench.drafting.draft_weights import quantized_draft_model
from mars_bench.drafting.stop import check_draft_cost, check_min_confidence
from mars_bench.method import MethodSpec
from mars_bench.models.loading import chat_prompt_ids
from mars_bench.models.sources import resolve_model
from mars_bench.perf.costs import (
    ForwardTimer,
    calibrated_costs,
    capped_step_speedups,
    forward_seconds,
    predicted_step_speedup,
)
from mars_bench.perf.peer import PEER_LOADING, assistant_settings, load_peer, peer_generate, peer_generation_config
from mars_bench.perf.report import REPORT_VERSION, drafter_label
from mars_bench.perf.vllm_peer import ENFORCE_EAGER, VLLM_PEERS, VllmEngines, check_vllm_peers
from mars_bench.tasks.options import task_option
from mars_bench.tasks.providers import load_questions
from mars_bench.verification.sampling import SamplingParams

OURS, PEER, VLLM = "ours", "transformers", "vllm"
# transformers' methods: generate (greedy), assisted generation with the assistant as loaded, and with the
# draft weights of each of our configurations (like for like: quantized as that configuration's drafter is)
PEER_METHODS = ("generate", "assisted", "assisted-like")
ALL_PEERS = PEER_METHODS + VLLM_PEERS  # vLLM's are asked for by name: two more engines, in an environment of their own
Raw = dict[str, list[list[dict[str, Any]]]]  # method name -> per repeat -> per prompt: one timed run


def chain_drafters_of_a_model() -> list[str]:
    """The registered drafters the suite times: chains drafted by a separate draft model, as assisted generation and
    vLLM's draft-model speculative decoding draft."""
    return [name for name in available_drafters() if drafter_needs_model(name) and not is_tree_drafter(name)]


@dataclass(frozen=True)
class DraftConfig:
    """One configuration of the suite's drafter: its draft-length policy (``drafter.length``) and its own settings,
    an instance of the drafter's settings class (``drafter_settings(PerfSettings.drafter)``: the app's ``drafter.*``
    keys, e.g. ``draft_vocab``, ``weights``, ``guesses``, ``context_vocab``, checked by the drafter when made)."""

    length: str
    settings: Any

    @classmethod
    def of(cls, drafter: str, length: str, **settings: Any) -> DraftConfig:
        """The configuration of the registered ``drafter`` under ``length`` with its ``settings`` by name (unset ones at
        the drafter's defaults; ValueError, in one line, for a value the drafter refuses)."""
        return cls(length, build_settings(drafter, **settings))

    @property
    def name(self) -> str:
        return drafter_label(self.length, asdict(self.settings))

    @property
    def drafter_key(self) -> str:
        """The forward-cost table's key for this configuration's draft model (its vocabulary,
        and its weights if quantized: the draft length does not change a forward)."""
        s = self.settings
        return str(s.draft_vocab) + ("+context" if s.context_vocab else "") + (f":{s.weights}" if s.weights else "")


@dataclass(frozen=True)
class PerfSettings:
    target: str
    draft_model: str
    dtype: str = "bfloat16"
    tasks: tuple[str, ...] = ("humaneval", "gsm8k")
    num_prompts: int = 10
    skip_prompts: int = 0  # time each task's prompts after its first skip_prompts (e.g. prompts a tuning did not see)
    max_new_tokens: int = 128
    repeats: int = 3
    gamma: int = DEFAULT_LENGTH.gamma
    vllm_gamma: int | None = None  # vLLM's draft-model speculation's drafts a step where they differ from ours (None: gamma)
    draft_lengths: tuple[str, ...] = ("fixed",)
    draft_vocabs: tuple[int | None, ...] = (None,)
    configurations: tuple[DraftConfig, ...] = ()  # given one by one, instead of every length with every vocabulary
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_gamma: int = DEFAULT_LENGTH.max_gamma  # the schedule policy's longest draft
    min_confidence: float = DEFAULT_LENGTH.min_confidence  # the confidence policy's stop
    draft_cost: float = DEFAULT_LENGTH.draft_cost  # the gain policy's cost of one more drafted token, in target forwards
    peers: tuple[str, ...] = PEER_METHODS  # transformers' methods timed (see methods_for)
    token_counts: str | None = None  # the count that ranks the draft vocabulary (None: the built-in ShareGPT count)
    data_dir: str | None = None
    kernels: str = DEFAULT_KERNELS  # our models' linear layers on the CPU (model.kernels); transformers' loads as its users
    drafter: str = "model"  # the registered drafter of our configurations (chain_drafters_of_a_model)
    backend: str = "transformers"  # the registered backend our methods run on: this package's engine (Backend.own_engine)

    @property
    def peer_gamma(self) -> int:
        """The drafts a step of vLLM's draft-model speculative decoding."""
        return self.gamma if self.vllm_gamma is None else self.vllm_gamma

    def check(self) -> None:
        for option, value in (("num_prompts", self.num_prompts), ("max_new_tokens", self.max_new_tokens),
                              ("repeats", self.repeats), ("gamma", self.gamma)):  # fmt: skip
            if value < 1:
                raise ValueError(f"--{option.replace('_', '-')}={value} is invalid: allowed is an integer >= 1")
        if self.vllm_gamma is not None and self.vllm_gamma < 1:
            raise ValueError(f"--vllm-gamma={self.vllm_gamma} is invalid: allowed is an integer >= 1 (omitted: --gamma)")
        if self.vllm_gamma is not None and "vllm-spec" not in self.peers:
            raise ValueError(f"--vllm-gamma={self.vllm_gamma} is for vLLM's speculation: allowed with --peers vllm-spec")
        if self.skip_prompts < 0:
            raise ValueError(f"--skip-prompts={self.skip_prompts} is invalid: allowed is an integer >= 0")
        if self.drafter not in chain_drafters_of_a_model():
            raise ValueError(f"drafter={self.drafter!r} is invalid: the suite times chains drafted by the draft model, as "
                             f"assisted generation drafts: allowed are {', '.join(chain_drafters_of_a_model())}")  # fmt: skip
        check_backend(self.backend)
        if not backend_class(self.backend).own_engine:
            raise ValueError(f"backend={self.backend!r} is invalid: the suite times this package's engine (its forwards, "
                             "phases and steps): allowed is a backend whose own_engine is true, e.g. transformers")  # fmt: skip
        for config in self.configs():
            self.spec(config, 0.0)
        if self.token_counts is not None:
            check_count_file(self.token_counts)  # before any model loads
        check_min_confidence(self.min_confidence)
        check_draft_cost(self.draft_cost)
        check_kernels(self.kernels)
        for peer in self.peers:
            if peer not in ALL_PEERS:
                raise ValueError(f"--peers {peer} is invalid: allowed are {', '.join(ALL_PEERS)}")
        for temperature in self.temperatures:
            if temperature not in (0.0, 1.0):
                raise ValueError(f"--temperatures {temperature:g} is invalid: allowed are 0 (greedy) and 1 (sampling)")
        vllm = [peer for peer in self.peers if peer in VLLM_PEERS]
        if vllm and 0.0 not in self.temperatures:
            raise ValueError(f"--peers {' '.join(vllm)} is timed greedy only: allowed with it are --temperatures 0 or 0 1")
        check_vllm_peers(self.peers)

    def spec(self, config: DraftConfig | None, temperature: float) -> MethodSpec:
        """Our method for ``config`` (None: the AR baseline) at ``temperature``: the drafter in that configuration,
        verified by the strict rule (``Method.verifier``), checked."""
        sampling = SamplingParams(temperature)
        if config is None:
            return MethodSpec(sampling=sampling)
        length = DraftLengthSettings(config.length, self.gamma, self.max_gamma, self.min_confidence, self.draft_cost)
        verifier = Method(OURS, temperature, config).verifier
        return MethodSpec(self.drafter, config.settings, length, verifier, sampling=sampling)

    def configs(self) -> list[DraftConfig]:
        """``configurations`` if given, else each draft length with each draft vocabulary; each with a draft
        vocabulary ranked by ``token_counts`` where that is given."""
        configs = list(self.configurations) or [DraftConfig.of(self.drafter, length, draft_vocab=vocab)
                                                for length, vocab in itertools.product(self.draft_lengths, self.draft_vocabs)]
        if self.token_counts is None:
            return configs
        return [replace(config, settings=replace(config.settings, token_counts=self.token_counts))
                if config.settings.draft_vocab else config for config in configs]  # fmt: skip

    def backend_config(self) -> Any:
        """The app's run config our backend is built from: the target and draft model in the suite's dtype and kernels
        (the rest of ``model`` at the app's defaults), with the first configuration's method."""
        model = ModelConfig(name=self.target, target=self.target, draft_model=self.draft_model, dtype=self.dtype,
                            kernels=self.kernels)  # fmt: skip
        return backend_config(self.spec(self.configs()[0], self.temperatures[0]), model, self.backend)


@dataclass(frozen=True)
class Method:
    """One way to decode a prompt: ours (``config`` None: the autoregressive baseline), transformers'
    (``assisted``: assisted generation, else plain ``generate``) or vLLM's (``assisted``: its draft-model
    speculative decoding, else autoregressive)."""

    side: str
    temperature: float
    config: DraftConfig | None = None
    assisted: bool = False
    assistant_weights: str | None = None  # assisted generation: the assistant quantized as our drafter is (None: as loaded)

    @property
    def name(self) -> str:
        if self.side == PEER:
            label = "assisted generation" if self.assisted else "generate"
            label += f", {self.assistant_weights} assistant" if self.assistant_weights else ""
        elif self.side == VLLM:
            label = "draft-model speculative decoding" if self.assisted else "AR"
        else:
            label = f"chain {self.verifier}, {self.config.name}" if self.config else "AR baseline"
        return f"T={self.temperature:g} {self.side} {label}"

    @property
    def verifier(self) -> str | None:
        return None if self.config is None else strict_verifier(self.temperature)

    @property
    def vllm_peer(self) -> str:
        """The ``--peers`` name of a vLLM method."""
        return VLLM_PEERS[1] if self.assisted else VLLM_PEERS[0]


def methods_for(settings: PerfSettings) -> list[Method]:
    """At each temperature: our AR baseline, ``generate`` (greedy), assisted generation with the assistant as
    loaded and with it quantized as each of our configurations quantizes its drafter, vLLM's AR and its
    speculative decoding (greedy), and our configurations (of the peers' methods, those ``settings.peers`` names)."""
    like = [config.settings.weights for config in settings.configs()] if "assisted-like" in settings.peers else []
    weights = list(dict.fromkeys(([None] if "assisted" in settings.peers else []) + like))
    methods = []
    for temperature in settings.temperatures:
        methods.append(Method(OURS, temperature))
        if temperature == 0 and "generate" in settings.peers:
            methods.append(Method(PEER, temperature))
        methods += [Method(PEER, temperature, assisted=True, assistant_weights=value) for value in weights]
        if temperature == 0:
            methods += [Method(VLLM, temperature, assisted=peer == VLLM_PEERS[1]) for peer in VLLM_PEERS
                        if peer in settings.peers]  # fmt: skip
        methods += [Method(OURS, temperature, config) for config in settings.configs()]
    return methods


def first_turn_prompts(
    tokenizer: Any, task: str, num_prompts: int, data_dir: str | None = None, skip: int = 0
) -> list[list[int]]:
    """The chat-templated first turns of ``task``'s ``num_prompts`` questions after its first ``skip`` (from
    the shared data folder or, without it, the pinned registry package), as token ids."""
    config = task_option(task, num_prompts=skip + num_prompts)
    questions = load_questions(config, data_dir)[skip:]
    return [chat_prompt_ids(tokenizer, [question.turns[0]], config.system_prompt) for question in questions]


def task_prompts(tokenizer: Any, settings: PerfSettings) -> list[tuple[str, list[int]]]:
    """(task, prompt ids) of every prompt the suite times, task by task."""
    return [(task, prompt) for task in settings.tasks
            for prompt in first_turn_prompts(tokenizer, task, settings.num_prompts, settings.data_dir, settings.skip_prompts)]


class Suite:
    def __init__(self, settings: PerfSettings) -> None:
        settings.check()
        self.settings = settings
        self.methods = methods_for(settings)
        vllm = tuple(method.vllm_peer for method in self.methods if method.side == VLLM)
        # vLLM's engines first, on the same checkpoints and dtype (see vllm_peer): what they hold is then taken
        # before our models load, so model.kernels=auto packs ours only where the packed copies still fit
        self.vllm = VllmEngines(vllm, str(resolve_model(settings.target).path), str(resolve_model(settings.draft_model).path),
                                settings.dtype, settings.peer_gamma) if vllm else None  # fmt: skip
        self.backend: Any = None
        try:
            # Ours: the backend a cell builds from the same run config, with the models it loads (a draft model equal to
            # the target is the target's object, as in a cell), their tokenizers checked alike.
            self.backend = make_backend(settings.backend_config())
            models = self.backend.models()
            self.target, self.draft = models["target"], models["drafter"]
            # transformers' side runs on its own load, as its users load models (see peer.load_peer).
            transformers = any(method.side == PEER for method in self.methods)
            self.peer_target = load_peer(self.target.resolved.path, settings.dtype) if transformers else None
            self.peer_draft = load_peer(self.draft.resolved.path, settings.dtype) if transformers else None
            # Like for like: assisted generation drafts with the same weights as the configuration it is compared
            # with, quantized by the same function from the same checkpoint (the plain load stays as loaded).
            self.assistants = {method.assistant_weights: quantized_draft_model(self.peer_draft, method.assistant_weights)
                               for method in self.methods if method.side == PEER and method.assisted}  # fmt: skip
            self.stops = list(self.backend.stop_token_ids)
            prompts = task_prompts(self.backend.tokenizer, settings)
            self.prompts = [prompt for _, prompt in prompts]
            self.prompt_tasks = [task for task, _ in prompts]
            self.prepared: dict[Method, PreparedMethod] = {
                method: self.backend.prepare(method.name, settings.spec(method.config, method.temperature))
                for method in self.methods if method.side == OURS}  # fmt: skip
            pad = self.backend.tokenizer.pad_token_id
            self.pad_id = pad if pad is not None else self.stops[0]
        except BaseException:
            self.close()  # the engines started above
            raise
        self.meter = ContentionMeter()  # what other processes used while each decode was timed

    def close(self) -> None:
        """Stop vLLM's engines, if any (each a process holding a model and its KV cache), and let our backend go."""
        if self.vllm is not None:
            self.vllm.close()
        if self.backend is not None:
            self.backend.close()

    def drafter_module(self, config: DraftConfig) -> Any:
        """The draft model as ``config``'s drafter runs it (its cut head, its quantized weights), from the backend."""
        method = next(method for method in self.prepared if method.config == config)
        return self.backend.forward_modules(self.prepared[method])["drafter"]

    def run(self, method: Method, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        run = {OURS: self.ours, PEER: self.peer, VLLM: self.vllm_peer}[method.side]
        return run(method, prompt, seed, budget)

    def ours(self, method: Method, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        """One request of ``method`` through the backend, as a cell hands it one (a batch of one, its seed). A drafter
        whose model is the target's own object (a draft model equal to the target) has its forwards counted with the
        target's: a hook cannot tell the two apart."""
        prepared = self.prepared[method]
        modules = self.backend.forward_modules(prepared)
        target, drafter = modules["target"], modules.get("drafter")
        models = (target,) if drafter is None or drafter is target else (target, drafter)
        requests = Requests([prompt], [seed], budget, tuple(self.stops))
        (result,), timing = self.timed(models, lambda: self.backend.generate(prepared, requests))
        return {"tokens": result.tokens, **timing, "prefill_s": result.prefill_s, "decode_s": result.decode_s,
                "steps": result.verify_steps, "emitted": emitted_tokens(result.new_tokens), "drafted": result.drafted,
                "step_drafts": [step.drafted for step in result.steps], "step_accepted": [step.accepted for step in result.steps],
                "step_emitted": [step.emitted for step in result.steps],
                **{f"{phase}_s": value for phase, value in result.phase_seconds().items()}}  # fmt: skip

    def peer(self, method: Method, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        config = peer_generation_config(budget, method.temperature, self.stops, self.pad_id)
        assistant = self.assistants[method.assistant_weights] if method.assisted else None
        tokens, timing = self.timed((self.peer_target, assistant or self.peer_draft),
                                    lambda: peer_generate(self.peer_target, prompt, config, assistant, seed=seed))  # fmt: skip
        return {"tokens": cut_at_stop(tokens, self.stops, budget)[0], **timing}

    def vllm_peer(self, method: Method, prompt: list[int], seed: int, budget: int) -> dict[str, Any]:
        """One request to vLLM's engine, timed around the whole call from this process (the pipe to the worker
        included: well under a millisecond against a decode's seconds); its forwards are vLLM's, out of reach of
        the hooks."""
        answer, timing = self.timed((), lambda: self.vllm.generate(method.vllm_peer, prompt, budget, self.stops, seed))
        counters = answer["counters"] or {}
        return {"tokens": cut_at_stop(answer["tokens"], self.stops, budget)[0], **timing,
                "steps": counters.get("num_drafts", 0), "drafted": counters.get("num_draft_tokens", 0),
                "accepted": counters.get("num_accepted_tokens", 0)}  # fmt: skip

    def timed(self, models: tuple[Any, ...], call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        """``call()``, its wall seconds, and the count and seconds of each model's forwards inside it
        (``models``: the target and the drafter that side runs; none for vLLM's, which run in its process)."""
        with ForwardTimer(*models[:1]) as target, ForwardTimer(*models[1:]) as draft:
            self.meter.start()
            start = time.perf_counter()
            value = call()
            wall = time.perf_counter() - start
            contention = self.meter.stop()
        return value, {"seconds": wall, "target_forwards": target.calls, "target_forward_s": target.seconds,
                       "drafter_forwards": draft.calls, "drafter_forward_s": draft.seconds,
                       "target_widths": target.forwards, "drafter_widths": draft.forwards,
                       "other_load": contention.other_load, "disturbed": contention.disturbed()}  # fmt: skip

    def warm_up(self) -> None:
        for method in self.methods:
            self.run(method, self.prompts[0], 0, 8)

    def repeat(self, repeat: int) -> dict[str, list[dict[str, Any]]]:
        """Every method on every prompt, the methods' order rotated by one per prompt and per repeat."""
        runs: dict[str, list[dict[str, Any]]] = {method.name: [] for method in self.methods}
        for index, prompt in enumerate(self.prompts):
            shift = (index + repeat) % len(self.methods)
            for method in self.methods[shift:] + self.methods[:shift]:
                runs[method.name].append(self.run(method, prompt, 1000 * repeat + index, self.settings.max_new_tokens))
        return runs


def forward_use(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Target forwards per new token, and the mean seconds of a target and of a drafter forward."""
    totals = {key: sum(run[key] for run in runs) for key in ("target_forwards", "target_forward_s",
                                                             "drafter_forwards", "drafter_forward_s")}  # fmt: skip
    return {
        "target_forwards_per_token": totals["target_forwards"] / sum(len(run["tokens"]) for run in runs),
        "target_forward_ms": 1000 * totals["target_forward_s"] / max(1, totals["target_forwards"]),
        "drafter_forwards_per_target_forward": totals["drafter_forwards"] / max(1, totals["target_forwards"]),
        "drafter_forward_ms": 1000 * totals["drafter_forward_s"] / max(1, totals["drafter_forwards"]),
    }


def throughput(runs: list[dict[str, Any]], seconds: str = "seconds") -> float:
    return sum(len(run["tokens"]) for run in runs) / sum(run[seconds] for run in runs)


def ratio_stats(mine: list[list[dict[str, Any]]], other: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Throughput of ``mine`` over ``other`` (each: per repeat, the runs of every prompt in order):
    min / median / max over repeats and over single prompts."""
    ratios = [throughput(a) / throughput(b) for a, b in zip(mine, other)]
    per_prompt = [throughput([a]) / throughput([b]) for ra, rb in zip(mine, other) for a, b in zip(ra, rb)]
    return {"ratios": ratios, "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
            "prompt_min": min(per_prompt), "prompt_median": statistics.median(per_prompt),
            "prompt_max": max(per_prompt)}  # fmt: skip


def summarise_method(method: Method, repeats: list[list[dict[str, Any]]]) -> dict[str, Any]:
    runs = [run for repeat in repeats for run in repeat]
    row: dict[str, Any] = {
        "method": method.name, "side": method.side, "temperature": method.temperature,
        "config": None if method.config is None else asdict(method.config), "assisted": method.assisted,
        "tok_s": throughput(runs), "runs": len(runs), "disturbed_runs": sum(run["disturbed"] for run in runs),
        "forwards": None if method.side == VLLM else forward_use(runs),  # vLLM's forwards run in its process
    }  # fmt: skip
    if method.side == VLLM and method.assisted:  # from vLLM's own spec-decode counters: its steps that drafted
        steps = sum(run["steps"] for run in runs)
        row |= {"tau": (sum(run["accepted"] for run in runs) + steps) / steps if steps else None,
                "drafts_per_step": sum(run["drafted"] for run in runs) / steps if steps else None}  # fmt: skip
    if method.side == OURS:
        decode_s = sum(run["decode_s"] for run in runs)
        steps = sum(run["steps"] for run in runs)
        row |= {
            "decode_tok_s": sum(run["emitted"] for run in runs) / decode_s,
            "tau": sum(run["emitted"] for run in runs) / steps,
            "drafts_per_step": sum(run["drafted"] for run in runs) / steps,
            "phase_share": {phase: sum(run[f"{phase}_s"] for run in runs) / decode_s for phase in PHASES},
            # Prefill forwards are counted too, so this slightly overstates the decode loop's share.
            "outside_forwards_share": sum(run["prefill_s"] + run["decode_s"] - run["target_forward_s"] - run["drafter_forward_s"]
                                          for run in runs) / decode_s,
        }  # fmt: skip
    return row


def comparisons(methods: list[Method], raw: Raw, packed: bool | str = False, gamma: int | None = None) -> list[dict[str, Any]]:
    """Each of our speculative methods against our AR baseline, against assisted generation and against
    vLLM's speculative decoding at its temperature; our AR baseline and assisted generation against plain
    ``generate``; our AR baseline against vLLM's, and vLLM's speculative decoding against its AR. packed: whether our
    models' linear layers run packed (``model.kernels``; ``our_linears``), transformers' as it loads them; gamma: vLLM's
    drafts a step (``differences``)."""
    by_key = {(m.side, m.temperature, m.assisted, m.config, m.assistant_weights): m for m in methods}
    pairs = []
    for method in methods:
        t = method.temperature
        vllm_ar, vllm_spec = by_key.get((VLLM, t, False, None, None)), by_key.get((VLLM, t, True, None, None))
        if method.side == OURS and method.config is not None:
            # the same draft weights on both sides
            same_weights = by_key.get((PEER, t, True, None, method.config.settings.weights))
            pairs += [(method, by_key[(OURS, t, False, None, None)]), (method, same_weights), (method, vllm_spec)]
        elif t == 0 and (method.side, method.assisted) in ((OURS, False), (PEER, True)):
            pairs.append((method, by_key.get((PEER, t, False, None, None))))  # plain generate, if timed
        if method.side == OURS and method.config is None:
            pairs.append((method, vllm_ar))
        elif method.side == VLLM and method.assisted:
            pairs.append((method, vllm_ar))
    pairs = [(mine, other) for mine, other in pairs if other is not None]
    rows = []
    for mine, other in pairs:
        identical = sum(a["tokens"] == b["tokens"] for ra, rb in zip(raw[mine.name], raw[other.name]) for a, b in zip(ra, rb))
        rows.append({"method": mine.name, "against": other.name, **ratio_stats(raw[mine.name], raw[other.name]),
                     "identical": identical if mine.temperature == 0 else None,
                     "differs": differences(mine, other, packed, gamma),
                     "runs": sum(len(repeat) for repeat in raw[mine.name])})  # fmt: skip
    return rows


def our_linears(models: dict[str, Any]) -> bool | str:
    """How our models' linear layers run, for ``differences``: True where every one (role -> LoadedModel) is packed,
    False where none is, else which are and which are not (``model.kernels=auto`` leaves a model as loaded where its
    packed copy finds no room, as after two vLLM engines on a 24 GB machine)."""
    packed = {role.replace("_", " "): loaded.packed is not None for role, loaded in models.items()}
    if all(packed.values()) or not any(packed.values()):
        return all(packed.values())
    done = " and ".join(role for role, flag in packed.items() if flag)
    left = " and ".join(role for role, flag in packed.items() if not flag)
    return f"ours packed for oneDNN for the {done} but as loaded for the {left} (no room for its packed copy)"


def differences(mine: Method, other: Method, packed: bool | str = False, gamma: int | None = None) -> str:
    """What differs between the two sides of a comparison; the rest (target and draft weights, dtype,
    quantization, prompts, budget, temperature) is held the same. packed (``our_linears``), gamma: as ``comparisons``'."""
    if isinstance(packed, str):
        ours = packed
    else:
        ours = "ours packed for oneDNN (model.kernels)" if packed else "ours as loaded (model.kernels: stock)"
    if other.side == VLLM:  # vLLM always runs its own linear layers, so they differ, packed or not
        kernels = f"; the linear layers: {ours}, vLLM's its own (oneDNN, prepacked at load)"
    else:
        kernels = f"; the linear layers: {ours}, transformers' as loaded" if packed else ""
    return _differences(mine, other, gamma) + (kernels if mine.side == OURS and other.side != OURS else "")


def _differences(mine: Method, other: Method, gamma: int | None = None) -> str:
    if mine.side == OURS and mine.config is not None and other.side == OURS:
        return f"speculative decoding ({mine.config.name} drafter) against none, in our engine"
    if other.side == VLLM:
        return _vllm_differences(mine, other, gamma)
    if mine.side == OURS and mine.config is not None:
        parts = [f"the decoder: ours (draft length {mine.config.length}) against assisted generation (its own draft "
                 "length heuristic)"]  # fmt: skip
        if mine.config.settings.draft_vocab:
            parts.append(f"our drafter scores {scored_tokens(mine.config)}, the assistant its full vocabulary (no counterpart)")
        return "; ".join(parts)
    if mine.side == OURS:
        return "the autoregressive decoder: ours against transformers' generate"
    return "assisted generation's drafting against none, in transformers"


def _vllm_differences(mine: Method, other: Method, gamma: int | None) -> str:
    engine = (f"vLLM's CPU engine (enforce_eager={ENFORCE_EAGER}, its paged KV cache and attention kernels, "
              "one request at a time)")  # fmt: skip
    if mine.side == VLLM:
        return f"vLLM's draft-model speculative decoding ({gamma} drafts a step, its own rule) against none, in {engine}"
    if mine.config is None:
        return f"the engine: ours against {engine}, both autoregressive"
    parts = [f"the engine: ours against {engine}",
             f"the decoder: ours (draft length {mine.config.length}) against vLLM's ({gamma} drafts every step)"]  # fmt: skip
    settings = mine.config.settings
    if settings.weights:
        parts.append(f"the draft weights: ours {settings.weights}, vLLM's as loaded (no counterpart)")
    if settings.draft_vocab:
        parts.append(f"our drafter scores {scored_tokens(mine.config)}, vLLM's its full vocabulary (no counterpart)")
    if settings.guesses:
        parts.append(f"our drafter adds {settings.guesses} lookup guesses a forward (no counterpart)")
    return "; ".join(parts)


def scored_tokens(config: DraftConfig) -> str:
    """What ``config``'s reduced draft vocabulary scores: its K tokens (and the context's)."""
    return f"{config.settings.draft_vocab:,} tokens" + (" and the context's" if config.settings.context_vocab else "")


def forward_costs(suite: Suite) -> dict[str, Any]:
    """Forward seconds at a typical context (the prompts' median length plus half the budget): the
    target over 1 to (longest draft + 1) tokens, and one-token drafter forwards per draft model
    (vocabulary and weights)."""
    s = suite.settings
    context = int(statistics.median(len(p) for p in suite.prompts)) + s.max_new_tokens // 2
    longest = max(s.max_gamma if config.length == "schedule" else s.gamma for config in s.configs())
    drafters = {config.drafter_key: suite.drafter_module(config) for config in s.configs()}
    return {
        "context_tokens": context,
        "target": {width: forward_seconds(suite.target.model, context, width) for width in range(1, longest + 2)},
        "drafter": {vocab: forward_seconds(model, context, 1) for vocab, model in drafters.items()},
    }


def decode_forwards(runs: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(tokens fed, seconds) of each forward ``key`` names (``target_widths`` or ``drafter_widths``) in ``runs``,
    each run's first (its prefill) left out."""
    return [(width, seconds) for run in runs for width, seconds in run.get(key, [])[1:]]


def analytic_model(methods: list[Method], costs: dict[str, Any], raw: Raw,
                   results: dict[str, dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Per speculative method: the speedup over our AR baseline (decode time only) that forward costs
    predict for the steps it actually took, beside the measured one.

    ``predicted`` is calibrated on the decodes' own forwards (``calibrated_costs``, by tokens fed): the AR
    baseline's one-token forwards price the tokens autoregressive decoding makes, the method's own target
    forwards price each step's verify forward by its width, and its drafter forwards as they were fed
    (lookup guesses make some wider, and fewer). ``predicted_isolated`` is the same with the forward costs
    timed in isolation (``forward_costs``: one drafter forward per draft). The caps cut each step at k
    drafts, a draft priced at the method's drafter seconds per draft."""
    predictions = {}
    baseline_one_token = {}  # temperature -> the AR baseline's decodes' own one-token forward, seconds
    for method in methods:
        if method.side == OURS and method.config is None:
            forwards = decode_forwards([run for repeat in raw[method.name] for run in repeat], "target_widths")
            if forwards:
                baseline_one_token[method.temperature] = calibrated_costs(forwards, [1])[1]
    for method in methods:
        if method.side != OURS or method.config is None:
            continue
        runs = [run for repeat in raw[method.name] for run in repeat]
        step_drafts = [drafted for run in runs for drafted in run["step_drafts"]]
        steps = [step for run in runs for step in zip(run["step_drafts"], run["step_accepted"], run["step_emitted"])]
        emitted = sum(run["emitted"] for run in runs)
        draft_one = costs["drafter"][method.config.drafter_key]
        isolated = predicted_step_speedup(emitted, step_drafts, costs["target"], draft_one)
        widths = range(1, max(costs["target"]) + 1)
        target_forwards, drafter_forwards = decode_forwards(runs, "target_widths"), decode_forwards(runs, "drafter_widths")
        one_token = baseline_one_token.get(method.temperature)
        if target_forwards and drafter_forwards and one_token is not None:
            target_s = calibrated_costs(target_forwards, widths)
            drafter_s = calibrated_costs(drafter_forwards, {width for width, _ in drafter_forwards})
            per_draft = sum(drafter_s[width] for width, _ in drafter_forwards) / max(1, sum(step_drafts))
        else:  # a report's runs without their forwards' widths: the isolated costs only
            one_token, target_s, per_draft = costs["target"][1], costs["target"], draft_one
        predicted = predicted_step_speedup(emitted, step_drafts, target_s, per_draft, one_token)
        measured = results[method.name]["decode_tok_s"] / results[Method(OURS, method.temperature).name]["decode_tok_s"]
        capped = capped_step_speedups(steps, target_s, per_draft, one_token)
        best = max(capped, key=capped.get) if capped else None
        predictions[method.name] = {"predicted": predicted, "measured": measured, "ratio": measured / predicted,
                                    "predicted_isolated": isolated, "one_token_s": one_token, "draft_s": per_draft,
                                    "capped": capped, "best_cap": best,
                                    "of_optimum": measured / capped[best] if best else None}  # fmt: skip
    return {"costs": costs, "speedup_over_our_baseline": predictions}


def run_suite(settings: PerfSettings, after_repeat: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every method, ``settings.repeats`` times; ``after_repeat`` gets the report over the
    repeats done so far (so an interrupted run keeps what it measured)."""
    # Read once, as the run starts: a report rewritten after each repeat describes that start.
    environment = {"git": git_state(), "source_sha256": source_hash(), "packages": package_versions(),
                   "cpu": cpu_description(), "gpus": gpu_description()}  # fmt: skip
    suite = Suite(settings)
    try:
        suite.warm_up()
        costs = forward_costs(suite)
        raw: Raw = {method.name: [] for method in suite.methods}
        for repeat in range(settings.repeats):
            for name, runs in suite.repeat(repeat).items():
                raw[name].append(runs)
            report = build_report(suite, environment, costs, raw, repeat + 1)
            if after_repeat is not None:
                after_repeat(report)
    finally:
        suite.close()
    return report


def build_report(suite: Suite, environment: dict[str, Any], costs: dict[str, Any], raw: Raw, repeats_done: int) -> dict[str, Any]:
    results = {method.name: summarise_method(method, raw[method.name]) for method in suite.methods}
    return {
        "version": REPORT_VERSION,
        "settings": asdict(suite.settings),
        "environment": environment,
        "repeats_done": repeats_done,
        "prompts": len(suite.prompts),
        "prompt_tasks": suite.prompt_tasks,
        "peer_loading": PEER_LOADING.format(dtype=suite.settings.dtype) if suite.peer_target is not None else None,
        "vllm_loading": suite.vllm.loading if suite.vllm is not None else None,
        "packed_linears": {role: loaded.packed.describe() if loaded.packed else None
                           for role, loaded in (("target", suite.target), ("draft_model", suite.draft))},  # fmt: skip
        "assisted_generation": assistant_settings(suite.peer_draft) if suite.peer_draft is not None else None,
        "results": results,
        "comparisons": comparisons(suite.methods, raw, our_linears({"target": suite.target, "draft_model": suite.draft}),
                                   suite.settings.peer_gamma),
        "analytic": analytic_model(suite.methods, costs, raw, results),
        "raw": {name: [[{"seconds": run["seconds"], "tokens": len(run["tokens"])} for run in repeat] for repeat in repeats]
                for name, repeats in raw.items()},  # fmt: skip
    }
