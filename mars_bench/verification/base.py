"""The verifier contract: inputs, verdicts, reason codes, settings and the registry.

A verifier is a pure tensor function: it sees the drafted nodes, the drafter's
probabilities and the target's raw logits, and decides which drafts to keep and which
token to emit after them. It never calls a model and never does I/O.

Each verifier declares its settings once, as a frozen dataclass registered with it
(``register_verifier(name, params=...)``): the dataclass validates the values, names the
allowed keys (``get_verifier``, ``verifier_settings``) and is what ``describe`` reports. The
registry adds nothing to them: the exact-first window is a wrapper around a rule (``exact_first.py``).

Each verifier also declares its own statistics (``Verifier.statistics``, ``Statistic``): what its rule
measured or decided at every visited depth, beside the reason code (``Decisions.statistics``). The engine,
the serving plugin and the records carry them by the names declared, never by a rule's name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from mars_bench.common.reasons import Reason
from mars_bench.common.settings import check_settings_class, label_values, settings_from
from mars_bench.verification.sampling import Generators, SamplingParams

__all__ = [
    "COUNT",
    "VALUE",
    "Decisions",
    "NoParams",
    "Reason",
    "Statistic",
    "Verdict",
    "Verifier",
    "VerifyInput",
    "available_verifiers",
    "batch_steps",
    "check_choice",
    "check_range",
    "check_theta",
    "check_unit_interval",
    "get_verifier",
    "register_verifier",
    "statistic_lists",
    "verifier_settings",
]


@dataclass(frozen=True)
class VerifyInput:
    """One verification step. N drafted nodes; V vocabulary entries.

    draft_tokens: LongTensor[N], the drafted token ids.
    parents: LongTensor[N] on the CPU, parent node index, -1 for the root (the last
        committed token). A chain has parents [-1, 0, 1, ...].
    draft_probs: FloatTensor[N] or None, q(token) under the drafter's processed distribution.
    draft_dists: FloatTensor[N, V] or None, the drafter's full processed distributions. None
        means the drafts were chosen deterministically (q is one-hot at the draft).
    target_logits: FloatTensor[N + 1, V], raw target logits at the root and after every node.
    sampling: the processing (temperature, top_p, top_k) every verifier applies.
    drafts_per_row: None for one request's step. A step of B requests (``batch_steps``) gives
        N_b per request: each tensor above holds the requests' entries one after another (request
        b's N_b drafts, and its N_b + 1 target-logits rows, so target_logits is [N + B, V]), and
        ``parents`` index each request's own nodes. ``Verifier.verify_batch`` judges it.
    generated: None, or per request the tokens its answer generated before this step: its depth-d
        drafts are judged at generated position ``generated[b] + d`` (``exact_first`` reads it).
    """

    draft_tokens: torch.Tensor
    parents: torch.Tensor
    target_logits: torch.Tensor
    sampling: SamplingParams = SamplingParams()
    draft_probs: torch.Tensor | None = None
    draft_dists: torch.Tensor | None = None
    drafts_per_row: tuple[int, ...] | None = None
    generated: tuple[int, ...] | None = None

    @property
    def num_drafts(self) -> int:
        return int(self.draft_tokens.shape[0])

    @property
    def batch_size(self) -> int:
        """B, the requests judged in this step (1 unless built by ``batch_steps``)."""
        return 1 if self.drafts_per_row is None else len(self.drafts_per_row)

    def check(self) -> None:
        """Raise ValueError on inconsistent shapes (cheap: no host-device sync)."""
        n = self.num_drafts
        if self.drafts_per_row is not None and (
            not self.drafts_per_row or sum(self.drafts_per_row) != n or min(self.drafts_per_row) < 0
        ):
            allowed = f"a count >= 0 per request, summing to N = {n}"
            raise ValueError(f"drafts_per_row={self.drafts_per_row!r} is invalid: allowed is {allowed}")
        if self.generated is not None and (
            len(self.generated) != self.batch_size
            or not all(isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in self.generated)
        ):
            allowed = f"a count >= 0 per request ({self.batch_size})"
            raise ValueError(f"generated={self.generated!r} is invalid: allowed is {allowed}")
        if self.draft_tokens.dim() != 1:
            raise ValueError(f"draft_tokens must be 1-D, got shape {tuple(self.draft_tokens.shape)}")
        rows, shape = n + self.batch_size, "[N+1, V]" if self.drafts_per_row is None else "[N+B, V]"
        if self.target_logits.dim() != 2 or self.target_logits.shape[0] != rows:
            raise ValueError(f"target_logits must have shape {shape} = [{rows}, V], got {tuple(self.target_logits.shape)}")
        if self.target_logits.shape[1] < 1:
            raise ValueError("target_logits has an empty vocabulary axis")
        if tuple(self.parents.shape) != (n,):
            raise ValueError(f"parents must have shape [{n}], got {tuple(self.parents.shape)}")
        if self.draft_probs is not None and tuple(self.draft_probs.shape) != (n,):
            raise ValueError(f"draft_probs must have shape [{n}], got {tuple(self.draft_probs.shape)}")
        if self.draft_dists is not None and tuple(self.draft_dists.shape) != (n, self.target_logits.shape[1]):
            raise ValueError(
                f"draft_dists must have shape [{n}, {self.target_logits.shape[1]}], got {tuple(self.draft_dists.shape)}"
            )


def batch_steps(steps: Sequence[VerifyInput]) -> VerifyInput:
    """One step judging every request of ``steps`` (each one request's step) together.

    They must share the sampling settings, and give ``draft_probs``, ``draft_dists`` and ``generated``
    all or none; the drafts and logits are concatenated in order (see ``VerifyInput.drafts_per_row``).
    """
    if not steps:
        raise ValueError("batch_steps needs at least one step")
    first = steps[0]
    for step in steps:
        if step.drafts_per_row is not None:
            raise ValueError("batch_steps takes one request's steps, got a batched step")
        if step.sampling != first.sampling:
            raise ValueError(f"the steps of a batch share their sampling: got {step.sampling} and {first.sampling}")
        for field in ("draft_probs", "draft_dists", "generated"):
            if (getattr(step, field) is None) != (getattr(first, field) is None):
                raise ValueError(f"the steps of a batch give {field} all or none")
    joined = lambda field: None if getattr(first, field) is None else torch.cat([getattr(s, field) for s in steps])  # noqa: E731
    return VerifyInput(
        draft_tokens=torch.cat([step.draft_tokens for step in steps]),
        parents=torch.cat([step.parents for step in steps]),
        target_logits=torch.cat([step.target_logits for step in steps]),
        sampling=first.sampling,
        draft_probs=joined("draft_probs"),
        draft_dists=joined("draft_dists"),
        drafts_per_row=tuple(step.num_drafts for step in steps),
        generated=None if first.generated is None else tuple(count for step in steps for count in step.generated),
    )


COUNT, VALUE = "count", "value"  # the kinds of a statistic


@dataclass(frozen=True)
class Statistic:
    """A statistic a verifier declares and reports at every visited depth (``Decisions.statistics``).

    name: its key in decisions, step records, traces and records (a lowercase identifier).
    kind: ``count`` (a BoolTensor per visited depth: whether the event happened there; records keep its count
        over verified positions, tables its rate) or ``value`` (a FloatTensor per visited depth; records keep
        each verified position's value, None where it is not finite).
    meaning: what it is, in one line.
    """

    name: str
    kind: str
    meaning: str

    def __post_init__(self) -> None:
        if not (self.name.isidentifier() and self.name == self.name.lower()):
            raise ValueError(f"statistic name {self.name!r} is invalid: allowed is a lowercase identifier")
        check_choice(f"statistic {self.name} kind", self.kind, (COUNT, VALUE))

    def missing(self, depths: int) -> torch.Tensor:
        """The statistic at ``depths`` visited depths its rule did not judge: never happened (a count), NaN (a value)."""
        if self.kind == COUNT:
            return torch.zeros(depths, dtype=torch.bool)
        return torch.full((depths,), float("nan"))


def statistic_lists(
    declared: Sequence[Statistic], found: dict[str, torch.Tensor] | None
) -> tuple[dict[str, list[bool]], dict[str, list[float]]]:
    """A step's statistics (``Decisions.statistics``, on the CPU; None: the step judged no draft) as lists, by the
    verifier's ``declared`` ones: each count's flags and each value's numbers per visited depth. ValueError, in
    one line, where decisions lack a declared statistic."""
    found = found if found is not None else {item.name: item.missing(0) for item in declared}
    lacking = [item.name for item in declared if item.name not in found]
    if lacking:
        raise ValueError(f"the decisions lack the declared statistics {', '.join(lacking)}: a verifier reports every "
                         "statistic it declares (Verifier.statistics) at every step")  # fmt: skip
    flags = {item.name: found[item.name].bool().tolist() for item in declared if item.kind == COUNT}
    values = {item.name: found[item.name].float().tolist() for item in declared if item.kind == VALUE}
    return flags, values


@dataclass(frozen=True)
class Decisions:
    """Per visited depth (D = number of drafted positions judged), on the CPU.

    reasons: LongTensor[D] of Reason codes.
    statistics: per statistic the verifier declares (``Verifier.statistics``), its value at each visited depth,
        taken at the target-logits row that judged it: a BoolTensor[D] for a count, a FloatTensor[D] for a value.
        Empty for a verifier that declares none.
    """

    reasons: torch.Tensor
    statistics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def relaxed_count(self) -> int:
        return int((self.reasons == Reason.RELAXED).sum())


@dataclass(frozen=True)
class Verdict:
    """The outcome of one step.

    accepted: LongTensor[A], node indices of the accepted path, root to leaf.
    next_token: the bonus / correction token emitted after the path.
    decisions: what happened at every visited depth.
    path_tokens: the accepted path's draft token ids, brought to the host with the verdict (None
        where a verifier does not say), so that a caller needs no read of its own drafts.
    """

    accepted: torch.Tensor
    next_token: int
    decisions: Decisions
    path_tokens: list[int] | None = None

    @property
    def accepted_len(self) -> int:
        return int(self.accepted.shape[0])


@dataclass(frozen=True)
class NoParams:
    """The settings of a verifier that has none (``exact``, ``rejection``)."""


def check_theta(theta: object) -> float | None:
    """theta must be None (relaxation off) or a number in (0, 1]; returns it as a float."""
    if theta is None:
        return None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta <= 1:
        raise ValueError(f"theta={theta!r} is invalid: allowed is a number in (0, 1], or null to turn relaxation off")
    return float(theta)


def check_unit_interval(option: str, value: object) -> float:
    """``value`` must be a number in (0, 1]; returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{option}={value!r} is invalid: allowed is a number in (0, 1]")
    return float(value)


def check_range(option: str, value: object, low: float, high: float, allowed: str) -> float:
    """``value`` must be a finite number in [low, high] (``allowed`` says so in words); returns it as a float."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{option}={value!r} is invalid: allowed is {allowed}")
    return float(value)


def check_choice(option: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` must be one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{option}={value!r} is invalid: allowed are {', '.join(allowed)}")
    return str(value)


class Verifier:
    """Base class: subclasses implement ``verify``, set ``lossless``, declare their ``statistics`` (none by
    default) and are registered with their settings class.

    params: the verifier's settings, an instance of the dataclass it was registered with.
    statistics: what the rule reports at every visited depth besides the reason (``Decisions.statistics``
        holds exactly these names, for every step, greedy and sampling).
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    statistics: ClassVar[tuple[Statistic, ...]] = ()
    chains_only: ClassVar[bool] = False  # True: refuses a tree of drafts
    params_type: ClassVar[type] = NoParams

    def __init__(self, params: Any = None) -> None:
        if params is None:
            params = self.params_type()
        if not isinstance(params, self.params_type):
            raise TypeError(f"verifier {self.name} takes {self.params_type.__name__}, got {type(params).__name__}")
        self.params = params

    def verify(self, step: VerifyInput, *, generator: torch.Generator | None = None) -> Verdict:
        """The verdict on one request's step."""
        if step.batch_size != 1:
            raise ValueError(f"verify judges one request's step, got {step.batch_size}: a batched step goes to verify_batch")
        return self.verify_batch(step, generator=generator)[0]

    def verify_batch(self, step: VerifyInput, *, generator: Generators = None) -> list[Verdict]:
        """A verdict per request of ``step`` (``batch_steps``), in one call with no loop per token.

        generator: one generator the whole step draws from, or one per request (``sampling.RandomStreams``):
        with one per request, each request's verdict equals ``verify`` on its own step with its generator.
        """
        raise NotImplementedError

    def emission(self, step: VerifyInput) -> Any:
        """The exact distribution of the emitted token per judging row (``emission.Emission``), which
        ``fidelity=true`` needs; every shipped verifier has one (``TreeVerifier``)."""
        raise NotImplementedError(f"verifier {self.name} does not state its emission distribution (needed by fidelity=true)")

    def emission_batch(self, step: VerifyInput) -> list[Any]:
        """``emission`` of each request of a batched step (``batch_steps``), in the request's own rows."""
        raise NotImplementedError(f"verifier {self.name} does not state its emission distribution (needed by fidelity=true)")

    def describe(self) -> dict[str, object]:
        """The verifier's name and settings, for records and manifests (an ``OPTIONAL`` setting only
        when it is not at its default, as labels carry it)."""
        return {"name": self.name, **label_values(self.params)}


_REGISTRY: dict[str, type[Verifier]] = {}
V = TypeVar("V", bound=type[Verifier])


def register_verifier(name: str, params: type = NoParams) -> Callable[[V], V]:
    """Class decorator: make a verifier available to ``get_verifier(name, **settings)``.

    params: a frozen dataclass whose fields are the verifier's settings (with defaults) and
    whose ``__post_init__`` validates them.
    """
    check_settings_class("verifier", name, params)

    def wrap(cls: V) -> V:
        names = [statistic.name for statistic in cls.statistics]
        if len(set(names)) != len(names):
            raise TypeError(f"verifier {name} declares a statistic twice: {', '.join(names)}")
        cls.name = name
        cls.params_type = params
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_verifiers() -> list[str]:
    return sorted(_REGISTRY)


def _verifier_class(name: str) -> type[Verifier]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown verifier {name!r}: allowed are {', '.join(available_verifiers())}")
    return _REGISTRY[name]


def verifier_settings(name: str) -> type:
    """The settings dataclass of the verifier registered as ``name`` (its fields are the allowed keys)."""
    return _verifier_class(name).params_type


def get_verifier(name: str, **settings: object) -> Verifier:
    """Build the verifier registered as ``name`` with its settings (unset ones take their defaults)."""
    cls = _verifier_class(name)
    return cls(settings_from("verifier", name, cls.params_type, settings))
