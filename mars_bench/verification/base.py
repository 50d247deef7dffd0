"""The verifier contract: inputs, verdicts, reason codes, settings and the registry.

A verifier is a pure tensor function: it sees the drafted nodes, the drafter's
probabilities and the target's raw logits, and decides which drafts to keep and which
token to emit after them. It never calls a model and never does I/O.

Each verifier declares its settings once, as a frozen dataclass registered with it
(``register_verifier(name, params=...)``): the dataclass validates the values, names the
allowed keys (``get_verifier``, ``verifier_settings``) and is what ``describe`` reports. The
registry adds one setting to every lossy verifier's: ``exact_first`` (``WINDOW``, see
``exact_first.py``), the lossless rule for the first tokens of each answer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from mars_bench.common.reasons import Reason
from mars_bench.common.settings import OPTIONAL, check_settings_class, label_values, settings_from
from mars_bench.verification.sampling import Generators, SamplingParams

__all__ = [
    "Decisions",
    "NoParams",
    "Reason",
    "WINDOW",
    "Verdict",
    "Verifier",
    "VerifyInput",
    "available_verifiers",
    "batch_steps",
    "check_choice",
    "check_range",
    "check_theta",
    "check_unit_interval",
    "check_window",
    "get_verifier",
    "register_verifier",
    "register_window",
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


@dataclass(frozen=True)
class Decisions:
    """Per visited depth (D = number of drafted positions judged), on the CPU.

    reasons: LongTensor[D] of Reason codes.
    top1_logit, top2_logit: FloatTensor[D], the two largest processed target logits (z1 at
        the target's top token, the first index of the row maximum, as ``torch.argmax``).
    margin: FloatTensor[D], the MARS statistic z2 / z1 (inf or nan where z1 == 0).
    triggered: BoolTensor[D] for a verifier with a relaxation trigger (``has_trigger``):
        whether the rule's trigger fired on the row judging each depth, as that verifier
        decides it; None for a verifier without one.
    """

    reasons: torch.Tensor
    top1_logit: torch.Tensor
    top2_logit: torch.Tensor
    margin: torch.Tensor
    triggered: torch.Tensor | None = None

    @property
    def relaxed_count(self) -> int:
        return int((self.reasons == Reason.RELAXED).sum())

    @property
    def triggered_count(self) -> int | None:
        """Visited depths where the trigger fired; None for a verifier without a trigger."""
        return None if self.triggered is None else int(self.triggered.sum())


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


WINDOW = "exact_first"  # every lossy verifier's setting: the lossless rule for the first L tokens of each answer


def check_window(value: object) -> int:
    """``exact_first`` must be an integer >= 0 (0: off); returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{WINDOW}={value!r} is invalid: allowed is an integer >= 0 (0 = off)")
    return value


def settings_of(name: str, values: tuple[tuple[str, object], ...]) -> Any:
    """The registered settings of verifier ``name`` from (key, value) pairs: how a pickle rebuilds them."""
    return verifier_settings(name)(**dict(values))


def windowed(name: str, params: type) -> type:
    """``params`` with ``exact_first`` added (default 0, ``OPTIONAL``: labels carry it only when set), the
    settings class the registry holds for a lossy verifier: a subclass of ``params`` under its name, checked
    by ``params``'s own ``__post_init__`` first, pickled by the verifier's name (its class name is not its own)."""
    if WINDOW in {item.name for item in dataclasses.fields(params)}:
        raise TypeError(f"settings of verifier {name} declare {WINDOW}, which the registry adds to every lossy verifier")
    own_check = getattr(params, "__post_init__", None)

    def __post_init__(self: Any) -> None:
        if own_check is not None:
            own_check(self)
        check_window(getattr(self, WINDOW))

    def __reduce__(self: Any) -> tuple[Any, ...]:
        return settings_of, (name, tuple((item.name, getattr(self, item.name)) for item in dataclasses.fields(self)))

    window = (WINDOW, int, dataclasses.field(default=0, metadata=OPTIONAL))
    namespace = {"__post_init__": __post_init__, "__reduce__": __reduce__, "__doc__": params.__doc__}
    derived = dataclasses.make_dataclass(params.__name__, [window], bases=(params,), frozen=True, namespace=namespace)
    derived.__module__, derived.__qualname__ = params.__module__, params.__qualname__
    return derived


class Verifier:
    """Base class: subclasses implement ``verify``, set ``lossless`` (and ``has_trigger`` when
    their rule has a relaxation trigger), and are registered with their settings class.

    params: the verifier's settings, an instance of the dataclass it was registered with (of a lossy
        verifier: that class with ``exact_first``, ``windowed``; an instance of the declared class is taken too).
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    has_trigger: ClassVar[bool] = False
    chains_only: ClassVar[bool] = False  # True: refuses a tree of drafts
    params_type: ClassVar[type] = NoParams

    def __init__(self, params: Any = None) -> None:
        if params is None:
            params = self.params_type()
        if type(params) in self.params_type.__mro__[1:] and dataclasses.is_dataclass(params):  # the declared class
            params = self.params_type(**{item.name: getattr(params, item.name) for item in dataclasses.fields(params)})
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
    whose ``__post_init__`` validates them. A lossy verifier takes ``exact_first`` as well (``windowed``).
    """
    check_settings_class("verifier", name, params)

    def wrap(cls: V) -> V:
        cls.name = name
        cls.params_type = params if getattr(cls, "lossless", False) else windowed(name, params)
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
    """Build the verifier registered as ``name`` with its settings (unset ones take their defaults); with
    ``exact_first`` > 0, inside its window (``register_window``)."""
    cls = _verifier_class(name)
    verifier = cls(settings_from("verifier", name, cls.params_type, settings))
    return _WINDOW[0](verifier) if getattr(verifier.params, WINDOW, 0) else verifier


_WINDOW: list[Callable[[Verifier], Verifier]] = []  # the wrapper register_window names


def register_window(wrapper: Callable[[Verifier], Verifier]) -> Callable[[Verifier], Verifier]:
    """Decorator: ``get_verifier`` returns ``wrapper(verifier)`` for a verifier whose ``exact_first`` is set
    (``exact_first.ExactFirst``, registered as ``mars_bench.verification`` is imported)."""
    _WINDOW[:] = [wrapper]
    return wrapper
