"""The backend contract: given a method and a batch of prompts with their budgets, stops and seeds,
return one ``DecodeResult`` per prompt (tokens, timings, and the per-step trace where the backend has one).

Everything a backend builds for a method (a drafter on its models, a verifier) stays behind its
``PreparedMethod.handle``; the cell reads only the ``MethodSpec`` and the results."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mars_bench.decoding.trace import DecodeResult
from mars_bench.method import MethodSpec


class EngineStopped(RuntimeError):
    """A backend's engine is gone for good (its process died): the cell stops there, keeping the rows it wrote for a
    rerun to resume, instead of failing every later batch."""


@dataclass(frozen=True)
class MethodsPlan:
    """How a cell holds its methods: ``together`` (all prepared first, alternating per chunk), or one after the
    other (each prepared, run over every question, then released: the baseline's rows first). ``line``: the
    decision and its figures, in one line (None: nothing to say)."""

    together: bool = True
    line: str | None = None


@dataclass(frozen=True)
class PreparedMethod:
    """A method a backend has built: its label in records (``baseline`` or the verifier's name), the spec
    it was built from, and the backend's own objects for it (``handle``; opaque to everything else)."""

    label: str
    spec: MethodSpec
    handle: Any = None

    @property
    def judged(self) -> bool:
        """Whether a verifier judges drafts (False: the autoregressive baseline)."""
        return self.spec.verifier is not None


@dataclass(frozen=True)
class Requests:
    """Prompts decoded together, each with its own seed.

    prompts: token ids per request; seeds: one per request; max_new_tokens: each request's budget;
    stop_token_ids: tokens that end an answer (kept); stop_when: called with a request's new tokens
    after each step, True ends it (a stop string); shadows: verifiers judging each step's drafts beside
    the live one, by label; fidelity: record each verifier's exact cost per judged position; on_tokens:
    a progress callback given a lone request's new-token count (outside the method's time)."""

    prompts: Sequence[list[int]]
    seeds: Sequence[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    stop_when: Callable[[list[int]], bool] | None = None
    shadows: tuple[Any, ...] = ()
    fidelity: bool = False
    on_tokens: Callable[[int], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("prompts is empty: allowed is at least one prompt")
        if len(self.seeds) != len(self.prompts):
            raise ValueError(f"seeds: got {len(self.seeds)} for {len(self.prompts)} prompts: allowed is one seed per prompt")


class Backend(ABC):
    """What runs methods: built once per cell from its config, then asked for batches of requests."""

    name: ClassVar[str]
    # False: ``generate`` decodes its requests as one batch (the cell gives it batch_size at a time). True: it
    # serves them as a queue, batch_size in flight, a finished request's slot going to a waiting one (the cell
    # gives it every question of a turn at once when batch_size > 1; at 1, one at a time, each its own batch).
    serves_a_queue: ClassVar[bool] = False
    # True: this package's engine (``decoding/``) decodes, so its records' steps are the batched forwards that
    # ``python -m mars_bench.perf.batch_costs`` times (analysis/batching.py prices them so) and the drafter tunings
    # (conf/drafter_tuning, measured in that engine) apply. False: another engine, which neither describes.
    own_engine: ClassVar[bool] = False

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The target's tokenizer (chat prompts, stop tokens, answer text)."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the target's answer (EOS and the chat template's end of turn)."""

    @property
    @abstractmethod
    def device(self) -> Any:
        """Where the target takes its input (peak memory is read there)."""

    @abstractmethod
    def models(self) -> dict[str, Any]:
        """The loaded models by role (``target``, ``drafter``: ``models.loading.LoadedModel``) for the manifest;
        empty for a backend whose models the manifest cannot describe."""

    @abstractmethod
    def prepare(self, label: str, spec: MethodSpec) -> PreparedMethod:
        """Build ``spec`` on this backend's models (refusing, in one line, what it cannot run)."""

    @abstractmethod
    def describe(self, method: PreparedMethod) -> dict[str, Any]:
        """The manifest's account of a prepared method: its drafter's and verifier's own descriptions."""

    @abstractmethod
    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        """Decode ``requests`` together with ``method``: one result per prompt, in order."""

    def forward_modules(self, method: PreparedMethod) -> dict[str, Any]:
        """The modules whose calls run ``method``'s model forwards in this process, by role: ``target``, and ``drafter``
        where a separate draft model drafts (as the drafter runs it: its cut head, its quantized weights). What the
        perf suite's forward hooks count and time (``perf/costs.py``); empty where the forwards run elsewhere (another
        process)."""
        return {}

    def plan_methods(self, methods: Mapping[str, MethodSpec]) -> MethodsPlan:
        """Whether ``methods`` (label -> spec, in the order they would run one at a time) may be prepared and held
        together; ValueError, in one line, where not even one can be. Asked before any is prepared."""
        return MethodsPlan()  # the transformers backend's methods share the loaded models

    def release(self, method: PreparedMethod) -> None:
        """Let go of what ``prepare`` built for ``method`` once the cell is done with it."""
        return None

    def close(self) -> None:
        """Let go of what the backend started (processes, engines) once its cell is done; models a
        process-wide cache keeps for the next cell stay."""
        return None  # the transformers backend starts nothing


BackendFactory = Callable[[Any], Backend]  # the cell's resolved config -> a backend
BackendCheck = Callable[[Any, MethodSpec], None]  # the resolved config and its method -> ValueError (one line) if refused
_BACKENDS: dict[str, BackendFactory] = {}
_CHECKS: dict[str, BackendCheck] = {}


def register_backend(name: str, factory: BackendFactory, check: BackendCheck | None = None) -> None:
    """Make ``backend=name`` build its backend with ``factory(cfg)``; ``check(cfg, spec)`` refuses, before any
    model loads, a config (and its method) the backend cannot run."""
    _BACKENDS[name] = factory
    if check is not None:
        _CHECKS[name] = check


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[Backend]:
    """The class ``backend=name`` builds, whose ClassVars say how it differs (``own_engine``, ...); ``Backend``
    itself for a factory that is not a class (it declares nothing). ValueError, in one line, for an unknown name."""
    check_backend(name)
    factory = _BACKENDS[name]
    return factory if isinstance(factory, type) and issubclass(factory, Backend) else Backend


def check_backend(name: str) -> None:
    """ValueError, in one line, for a backend name nothing registered."""
    if name not in _BACKENDS:
        raise ValueError(f"backend={name!r} is unknown: allowed are {', '.join(available_backends())}")


def check_backend_config(cfg: Any, spec: MethodSpec) -> None:
    """The backend's name, then its own check of ``cfg`` and its method ``spec`` (ValueError, one line), before
    any model loads."""
    check_backend(cfg.backend)
    if cfg.backend in _CHECKS:
        _CHECKS[cfg.backend](cfg, spec)


def make_backend(cfg: Any) -> Backend:
    """The backend ``cfg.backend`` names, built from ``cfg`` (its models loaded)."""
    check_backend(cfg.backend)
    return _BACKENDS[cfg.backend](cfg)
