"""One way to decode a prompt, described once and built in one place.

A ``MethodSpec`` holds what a method is: the drafter and its settings, the draft-length policy,
the verifier and its settings, and the sampling. It checks all of them when it is made (before
any model loads, each error in one line) and builds the drafter, the verifier and the arguments
of ``decode``. The app's cell, the performance suite and the lm-eval model all build their
methods from it, so a drafter, a policy or a verifier is assembled the same way everywhere.
The autoregressive baseline is the spec with drafter ``none`` and no verifier.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mars_bench.common.settings import label_items, label_values, setting_string, values_label
from mars_bench.decoding.draft_length import DraftLength, DraftLengthSettings, draft_length_policy
from mars_bench.decoding.engine import DecodeSettings
from mars_bench.drafting import build_settings, drafter_for, drafter_needs_model, drafters_with_stops, is_tree_drafter
from mars_bench.drafting import drafter_settings as drafter_settings_class
from mars_bench.drafting.draft_vocab import check_count_file
from mars_bench.drafting.stop import DraftStop
from mars_bench.drafting.tree import TreeShape
from mars_bench.verification import WINDOW, Verifier, get_verifier, with_exact_first
from mars_bench.verification import verifier_settings as verifier_settings_class
from mars_bench.verification.sampling import SamplingParams

BASELINE_DRAFTER = "none"  # the registered drafter that drafts nothing: autoregressive decoding


def check_tree_judges(drafter: str, verifiers: dict[str, Verifier]) -> None:
    """Refuse, in one line, the verifiers (by label) that judge chains only, under a drafter of trees."""
    chain_only = [label for label, verifier in verifiers.items() if verifier.chains_only]
    if is_tree_drafter(drafter) and chain_only:
        raise ValueError(
            f"drafter={drafter} drafts trees, which {', '.join(chain_only)} cannot judge: "
            "use a chain drafter (model, layerskip, lookup) or a verifier that judges trees"
        )


@dataclass(frozen=True)
class MethodSpec:
    """A method, checked on construction.

    drafter: a registered drafter name (``none``: the autoregressive baseline); drafter_settings:
    its settings (an instance of ``drafter_settings(drafter)``). length: the draft-length policy
    and its keys (gamma, max_gamma, min_confidence, draft_cost). verifier: a registered verifier name, None
    for the baseline; verifier_settings: an instance of ``verifier_settings(verifier)``; exact_first: the window
    wrapped around a lossy verifier (``verification.exact_first``; 0: none).
    sampling: temperature, top_p and top_k, shared by drafter and verifier.
    Build one from keys by name with ``MethodSpec.create`` (or ``method_spec(cfg)`` in the app).
    """

    drafter: str = BASELINE_DRAFTER
    drafter_settings: Any = None
    length: DraftLengthSettings = field(default_factory=DraftLengthSettings)
    verifier: str | None = None
    verifier_settings: Any = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    exact_first: int = 0

    @classmethod
    def create(
        cls,
        drafter: str = BASELINE_DRAFTER,
        verifier: str | None = None,
        *,
        drafter_settings: dict[str, Any] | None = None,
        verifier_settings: dict[str, Any] | None = None,
        length: DraftLengthSettings | None = None,
        sampling: SamplingParams | None = None,
    ) -> MethodSpec:
        """The spec from settings by name (unset ones at their defaults; ``exact_first`` among the verifier's: the
        window around it), every value checked."""
        own = {key: value for key, value in (verifier_settings or {}).items() if key != WINDOW}
        window = (verifier_settings or {}).get(WINDOW, 0)
        built_verifier = None if verifier is None else with_exact_first(get_verifier(verifier, **own), window)
        return cls(
            drafter=drafter,
            drafter_settings=build_settings(drafter, **(drafter_settings or {})),
            length=length or DraftLengthSettings(),
            verifier=verifier,
            verifier_settings=None if built_verifier is None else built_verifier.params,
            sampling=sampling or SamplingParams(),
            exact_first=window if built_verifier is not None else 0,
        )

    def __post_init__(self) -> None:
        if self.drafter_settings is None:
            object.__setattr__(self, "drafter_settings", build_settings(self.drafter))
        if not isinstance(self.drafter_settings, drafter_settings_class(self.drafter)):
            raise TypeError(f"drafter {self.drafter} takes {drafter_settings_class(self.drafter).__name__}, "
                            f"got {type(self.drafter_settings).__name__}")  # fmt: skip
        if self.verifier is not None and self.verifier_settings is None:
            object.__setattr__(self, "verifier_settings", verifier_settings_class(self.verifier)())
        if self.drafts and self.verifier is None:
            raise ValueError(f"drafter={self.drafter} needs a verifier: allowed are the registered verifiers")
        self.check()

    @property
    def drafts(self) -> bool:
        """Whether this method drafts (False: the autoregressive baseline)."""
        return self.drafter != BASELINE_DRAFTER

    @property
    def tree(self) -> bool:
        return is_tree_drafter(self.drafter)

    @property
    def needs_draft_model(self) -> bool:
        return drafter_needs_model(self.drafter)

    @property
    def max_draft_depth(self) -> int:
        """The deepest draft a draft-length schedule may ask for: ``max_gamma``, and for a tree no
        deeper than its node budget holds (``tree_tokens - 1``), so the schedule never runs ahead of it."""
        if self.tree:
            return min(self.length.max_gamma, self.drafter_settings.tree_tokens - 1)
        return self.length.max_gamma

    def draft_stop(self) -> DraftStop | None:
        """The drafter's stop rule (``DraftLengthSettings.draft_stop``; checked), None under fixed and schedule."""
        return self.length.draft_stop()

    def check(self) -> None:
        """Every value that types cannot check, in one line each (called on construction)."""
        DecodeSettings(gamma=self.length.gamma)
        draft_length_policy(self.length.length, self.length.gamma, self.max_draft_depth)
        stopping, policy = drafters_with_stops(), self.length.length
        if self.length.draft_stop() is not None and self.drafter not in (BASELINE_DRAFTER, *stopping):
            raise ValueError(f"drafter.length={policy} ends drafts by the drafter's own q, which drafter={self.drafter} does not "
                             f"apply: allowed with it are fixed and schedule ({policy}: {', '.join(stopping)})")  # fmt: skip
        if self.tree:
            TreeShape(self.length.gamma, self.drafter_settings.top_k, self.drafter_settings.tree_tokens)
            check_tree_judges(self.drafter, {self.verifier: self.build_verifier()} if self.verifier else {})
        if getattr(self.drafter_settings, "token_counts", None):
            check_count_file(self.drafter_settings.token_counts)
        if self.exact_first:
            if self.verifier is None:
                raise ValueError(f"{WINDOW}={self.exact_first} is invalid for the baseline, which verifies nothing: allowed is 0")
            self.build_verifier()  # a lossless verifier takes no window

    def build_verifier(self) -> Verifier | None:
        """The verifier with its settings, inside its exact-first window where ``exact_first`` is set."""
        if self.verifier is None:
            return None
        return with_exact_first(get_verifier(self.verifier, **dataclasses.asdict(self.verifier_settings)), self.exact_first)

    def build_drafter(self, target: Any, draft_model: Any = None, *, head: Any = None, tokenizer: Any = None) -> Any:
        """The drafter for ``target`` (None for the baseline); ``draft_model``: the separate draft model
        of ``model``/``model_tree``; ``head``: the EAGLE-3 head; ``tokenizer``: the target's."""
        return drafter_for(self.drafter, target, draft_model, head=head, stop=self.draft_stop(),
                           tokenizer=tokenizer, **dataclasses.asdict(self.drafter_settings))  # fmt: skip

    def draft_length_policy(self) -> DraftLength:
        """A fresh policy for one sequence (``schedule`` adapts to what that sequence accepts)."""
        return draft_length_policy(self.length.length, self.length.gamma, self.max_draft_depth)

    def decode_kwargs(self) -> dict[str, Any]:
        """``decode``'s method arguments for one sequence (the caller adds budget, stops and seed)."""
        sampling = self.sampling
        return {"gamma": self.length.gamma, "temperature": sampling.temperature, "top_p": sampling.top_p,
                "top_k": sampling.top_k, "draft_length": self.draft_length_policy()}  # fmt: skip

    def with_sampling(self, sampling: SamplingParams) -> MethodSpec:
        return dataclasses.replace(self, sampling=sampling)

    @property
    def drafter_setting(self) -> str:
        """The keys that shape the drafter's drafts: gamma and its own settings, e.g. ``gamma=5,top_k=3,tree_tokens=16``
        (a setting added later is left out at its default, so older records keep their label)."""
        values = {item.name: getattr(self.drafter_settings, item.name) for item in dataclasses.fields(self.drafter_settings)}
        return setting_string({"gamma": self.length.gamma, **label_items(type(self.drafter_settings), values)})

    @property
    def verifier_values(self) -> dict[str, Any]:
        """The verifier's settings as labels carry them, then its window where it has one (empty for the baseline):
        what ``build_verifier().describe()`` gives but the name."""
        if self.verifier_settings is None:
            return {}
        return {**label_values(self.verifier_settings), **({WINDOW: self.exact_first} if self.exact_first else {})}

    @property
    def verifier_label(self) -> str:
        """``mars(theta=0.9,guard=never,correction=residual,exact_first=16)``: the verifier as labels name it."""
        return values_label(str(self.verifier), self.verifier_values)
