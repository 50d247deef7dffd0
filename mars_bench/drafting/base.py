"""The drafter interface and registry.

Each drafter declares its settings once, as a frozen dataclass (field defaults = the drafter's
defaults, ranges checked in ``__post_init__``), and registers a factory under its name with
``register_drafter``. What a drafter is built from besides its settings (the loaded models,
the device, the EAGLE-3 head source, the stop rule set by the draft-length policy)
is its ``DrafterContext``: never a setting.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.common.settings import check_settings_class, label_values, settings_from
from mars_bench.drafting.stop import DraftStop
from mars_bench.models.placement import input_device
from mars_bench.verification.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """N proposed tokens: a chain, or a tree when ``parents`` is given.

    tokens: LongTensor[N] on the target's device.
    parents: LongTensor[N] on the CPU or None (a chain): each node's parent node, -1 for a
        child of the root, parents before children (see ``drafting/tree.py``).
    probs: FloatTensor[N] or None, q(token) under the drafter's processed distribution.
    dists: FloatTensor[N, V] or None, the full processed distributions (only when the
        drafter sampled; None means the tokens were chosen deterministically).
    host_tokens: LongTensor[N] on the CPU or None: ``tokens`` as the drafter already brought
        them to the host (with ``parents``, in one transfer), so the engine needs no other.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    dists: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    host_tokens: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def token_list(self) -> list[int]:
        """The drafted token ids on the host (a transfer only when the drafter made no host copy)."""
        return (self.tokens if self.host_tokens is None else self.host_tokens).tolist()


@dataclass(frozen=True)
class NoSettings:
    """The settings of a drafter that has none of its own (``none``; ``model``, whose draft
    length is the engine's gamma and draft-length policy)."""


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter is built from besides its settings; each factory reads what it needs.

    target: the target causal LM (layerskip shares its layers; eagle3 reads its config,
    embeddings and device). model: the separate draft model (model, model_tree). vocab_size:
    the target's logits width (drafter distributions are fitted to it). device: where drafts
    go when the drafter has no model to say so (lookup; default CPU). head: the EAGLE-3 head,
    a folder or Hub id (``model.eagle3_head``) or a loaded ``Eagle3Head``. stop: the rule that
    may end a draft early (``drafting/stop.py``); set only under ``drafter.length=confidence`` or
    ``gain`` and read by the drafters that have a q to judge (model, layerskip). tokenizer: the
    target's, for the model drafters' built-in token count (``drafter.draft_vocab``).
    """

    target: Any = None
    model: Any = None
    vocab_size: int | None = None
    device: torch.device | str | None = None
    head: Any = None
    stop: DraftStop | None = None
    tokenizer: Any = None


class Drafter:
    """Proposes tokens after the committed context of each of the B rows the engine decodes together
    (``decoding/engine.py``); one sequence is a batch of one. The one contract every registered drafter
    serves, at every B.

    Lifecycle per batch: ``begin(prompts, features)`` once, then per step ``propose(contexts, limits,
    sampling, generators)`` and ``accept(paths, features)``; ``keep(rows)`` when rows leave the batch.
    ``prompts`` and ``contexts`` hold each row's committed tokens (prompt and generated) as CPU
    LongTensors; ``limits[b]`` (>= 0) bounds the number of drafted tokens on any path of row b (a chain's
    length, a tree's depth), and a row with limit 0 gets None; ``generators[b]`` is row b's random
    stream (None: torch's default), the one its verdict draws from next, so a row that draws must draw
    what it draws alone. Each row's drafts are the ones it gets alone, up to the numerics of batched
    forwards.

    A drafter that reads the target's hidden states (EAGLE) names the entries of the target's
    ``output_hidden_states`` it needs in ``hidden_layers``; the engine then hands it, per row,
    ``features[b]``: those entries concatenated along the hidden axis ([rows, len * hidden]), for every
    committed token but the newest, computed by the target forwards the engine runs anyway: the
    prompt's rows in ``begin``, the root's and the accepted nodes' rows in ``accept``.

    A drafter written for one sequence subclasses ``SequenceDrafter`` instead, which serves a batch
    row by row. ``settings``: the drafter's settings dataclass instance (as used: a default the drafter
    resolves from its context is stored resolved).
    """

    name: str = "base"
    settings: Any = NoSettings()
    hidden_layers: tuple[int, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass whose ``propose`` has the one-sequence signature of drafters written before this contract
        (``context, max_drafts``) is refused where it is defined, in one line, rather than failing at its first
        step on a list of contexts."""
        super().__init_subclass__(**kwargs)
        propose = cls.__dict__.get("propose")
        if callable(propose) and list(inspect.signature(propose).parameters)[1:3] == ["context", "max_drafts"]:
            raise TypeError(f"{cls.__name__}.propose(context, max_drafts, ...) drafts one sequence: allowed are "
                            "Drafter.propose(contexts, limits, sampling, generators) over a batch's rows, or a "
                            "SequenceDrafter subclass giving propose_sequence(context, max_drafts, sampling, generator)")

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        """Start a batch (prompts: CPU LongTensor[P_b] per row; features: [P_b, F] per row, or None)."""

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        """A Draft per row (None where it drafts nothing), at most ``limits[b]`` drafts deep."""
        raise NotImplementedError

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        """Each row's kept nodes of its last proposal (node indices, root to leaf; [] where it had none);
        for a chain that is ``range(accepted_len)``. features[b]: [len(path) + 1, F] (the root's row, then
        the path's) or None."""

    def keep(self, rows: list[int]) -> None:
        """Only the rows ``rows`` (indices into the current batch) stay."""

    def describe(self) -> dict[str, object]:
        """What the records carry about this drafter: its name, its settings (as labels carry them:
        a setting added later is left out at its default), then ``facts()``."""
        return {"name": self.name, **label_values(self.settings), **self.facts()}

    def facts(self) -> dict[str, object]:
        """Facts of the drafter's context that the records carry beside its settings (none here)."""
        return {}


class SequenceDrafter(Drafter):
    """A drafter written for one sequence, serving a batch row by row: subclasses give ``propose_sequence``
    (and ``begin_sequence``, ``accept_sequence`` where they keep state per sequence).

    Each row drafts with its own shallow copy of this drafter (``sequence_copy``), made at ``begin``: the
    weights and settings are shared, and every attribute ``begin_sequence`` sets is the row's own. One
    Python call per row per step: the form for a drafter with no tensor work to share across rows
    (``lookup``, a drafter of your own); the model drafters batch their forwards instead.
    """

    sequences: list[SequenceDrafter]  # this batch's rows, one copy each (set by ``begin``)

    def begin_sequence(self, prompt: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """Start one sequence (prompt: CPU LongTensor[P]; features: [P, F] or None)."""

    def propose_sequence(self, context: torch.Tensor, max_drafts: int, sampling: SamplingParams,
                         generator: torch.Generator | None) -> Draft:  # fmt: skip
        """At most ``max_drafts`` (>= 1) drafts after ``context`` (CPU LongTensor[T], every committed token)."""
        raise NotImplementedError

    def accept_sequence(self, path: list[int], features: torch.Tensor | None = None) -> None:
        """The kept nodes of the last proposal (``Drafter.accept``'s, for this sequence)."""

    def sequence_copy(self) -> SequenceDrafter:
        """The drafter one row drafts with: a shallow copy (override where a copy must not share some state)."""
        return copy.copy(self)

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor] | None = None) -> None:
        self.sequences = []  # emptied first, so that no copy holds the last batch's rows
        self.sequences = [self.sequence_copy() for _ in prompts]
        for index, (sequence, prompt) in enumerate(zip(self.sequences, prompts)):
            sequence.begin_sequence(prompt, None if features is None else features[index])

    def propose(self, contexts: Sequence[torch.Tensor], limits: Sequence[int], sampling: SamplingParams,
                generators: Sequence[torch.Generator | None]) -> list[Draft | None]:  # fmt: skip
        draws = zip(self.sequences, contexts, limits, generators)
        return [sequence.propose_sequence(context, limit, sampling, stream) if limit > 0 else None
                for sequence, context, limit, stream in draws]  # fmt: skip

    def accept(self, paths: Sequence[list[int]], features: Sequence[torch.Tensor] | None = None) -> None:
        for index, (sequence, path) in enumerate(zip(self.sequences, paths)):
            sequence.accept_sequence(path, None if features is None else features[index])

    def keep(self, rows: list[int]) -> None:
        self.sequences = [self.sequences[row] for row in rows]


DrafterFactory = Callable[[Any, DrafterContext], "Drafter | None"]


@dataclass(frozen=True)
class DrafterSpec:
    """A registered drafter: its factory(settings, context), its settings class, whether it
    needs a separate draft model (``model.draft_model``), whether it drafts trees and whether it
    applies a stop rule (``DrafterContext.stop``)."""

    name: str
    factory: DrafterFactory
    settings: type
    needs_draft_model: bool = False
    tree: bool = False
    stops: bool = False


_REGISTRY: dict[str, DrafterSpec] = {}


def register_drafter(
    name: str, settings: type = NoSettings, needs_draft_model: bool = False, tree: bool = False, stops: bool = False
) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register ``factory(settings, context) -> Drafter`` as the drafter ``name``; ``settings``
    is its frozen settings dataclass; ``stops``: it applies ``DrafterContext.stop``."""
    check_settings_class("drafter", name, settings)

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = DrafterSpec(name, factory, settings, needs_draft_model, tree, stops)
        return factory

    return wrap


@register_drafter("none")
def _no_drafter(settings: NoSettings, context: DrafterContext) -> None:
    """Plain autoregressive decoding: no drafter."""
    return None


def available_drafters() -> list[str]:
    return sorted(_REGISTRY)


def drafter_spec(name: str) -> DrafterSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown drafter {name!r}: allowed are {', '.join(available_drafters())}")
    return _REGISTRY[name]


def check_drafter_name(name: str) -> str:
    drafter_spec(name)
    return name


def drafter_settings(name: str) -> type:
    """The settings dataclass of the drafter ``name``."""
    return drafter_spec(name).settings


def drafter_needs_model(name: str) -> bool:
    """Whether the drafter ``name`` drafts with a separate draft model (``model.draft_model``)."""
    return drafter_spec(name).needs_draft_model


def drafters_with_stops() -> list[str]:
    """The drafters that apply a stop rule (``drafter.length=confidence`` or ``gain``)."""
    return [name for name in available_drafters() if drafter_spec(name).stops]


def drafters_without_model() -> str:
    """The drafters that need no separate draft model, as an error message lists them."""
    return ", ".join(name for name in available_drafters() if not drafter_needs_model(name))


def is_tree_drafter(name: str) -> bool:
    """Whether the drafter ``name`` drafts trees (its depth is gamma, its size ``tree_tokens``)."""
    return drafter_spec(name).tree


def build_settings(name: str, **values: object) -> Any:
    """The drafter ``name``'s settings from ``values`` (defaults for the rest), checked."""
    return settings_from("drafter", name, drafter_settings(name), values)


def build_drafter(
    name: str,
    *,
    target: Any = None,
    model: Any = None,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
    head: Any = None,
    stop: DraftStop | None = None,
    tokenizer: Any = None,
    **settings: object,
) -> Drafter | None:
    """The drafter registered as ``name`` (``none`` gives None: plain autoregressive decoding),
    built from its context (see ``DrafterContext``) and its ``settings`` by name."""
    spec = drafter_spec(name)
    context = DrafterContext(target, model, vocab_size, device, head, stop, tokenizer)
    return spec.factory(build_settings(name, **settings), context)


def drafter_for(
    name: str,
    target: Any,
    draft_model: Any = None,
    *,
    head: Any = None,
    stop: DraftStop | None = None,
    tokenizer: Any = None,
    **settings: object,
) -> Drafter | None:
    """The drafter ``name`` for ``target`` (a causal LM): its vocabulary size and input device
    come from the target; ``draft_model`` is the separate draft model (model, model_tree);
    ``tokenizer`` the target's (the model drafters' built-in token count)."""
    return build_drafter(
        name,
        target=target,
        model=draft_model,
        vocab_size=target.config.vocab_size,
        device=input_device(target),
        head=head,
        stop=stop,
        tokenizer=tokenizer,
        **settings,
    )


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device))
