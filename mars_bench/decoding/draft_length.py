"""Draft-length policies: how many tokens to ask the drafter for at the next step.

``fixed`` always asks for gamma. ``schedule`` adapts to recent acceptance: one more after a
step that kept every draft, one fewer after a step that rejected one (between ``minimum``
and ``maximum``). A confidence stop (drafting ends once the drafter's own probability of its
token falls below a threshold) lives in the drafter (``ModelDrafter(min_confidence=...)``),
since only the drafter sees that probability while it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

LENGTH_POLICIES = ("fixed", "schedule", "confidence")


@dataclass(frozen=True)
class DraftLengthSettings:
    """How many drafts a step asks for: the one home of these keys' defaults (the app's ``drafter.*``
    keys, the perf suite and the lm-eval model take them from here).

    length: the policy, fixed | schedule | confidence. gamma: drafts per step (a tree's depth); under
    ``schedule`` the first step's, adapted between 1 and ``max_gamma``. min_confidence: under
    ``confidence``, the drafter ends a draft after a token it gives q below this.
    """

    length: str = "fixed"
    gamma: int = 5
    max_gamma: int = 16
    min_confidence: float = 0.4

    @property
    def confidence_stop(self) -> float | None:
        """The draft probability q below which the drafter ends a draft: ``min_confidence`` under the
        ``confidence`` policy, None (never) under the others."""
        return self.min_confidence if self.length == "confidence" else None


DEFAULT_LENGTH = DraftLengthSettings()


class DraftLength:
    """Asked before each step for the number of drafts; told afterwards what was kept."""

    def next(self) -> int:
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """The last step drafted ``drafted`` tokens and the verifier kept ``accepted``."""


@dataclass
class FixedLength(DraftLength):
    gamma: int

    def next(self) -> int:
        return self.gamma


@dataclass
class AcceptanceSchedule(DraftLength):
    gamma: int
    minimum: int = 1
    maximum: int = DEFAULT_LENGTH.max_gamma

    def next(self) -> int:
        return self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 1 if accepted == drafted else -1
        self.gamma = max(self.minimum, min(self.maximum, self.gamma + step))



def draft_length_policy(name: str, gamma: int, maximum: int = DEFAULT_LENGTH.max_gamma) -> DraftLength:
    """A fresh policy for one sequence. ``confidence`` drafts up to gamma per step; the drafter stops early."""
    if name not in LENGTH_POLICIES:
        raise ValueError(f"drafter.length={name!r} is invalid: allowed are {', '.join(LENGTH_POLICIES)}")
    if name == "schedule":
        if maximum < gamma:
            raise ValueError(f"drafter.max_gamma={maximum} is invalid: allowed is an integer >= gamma ({gamma})")
        return AcceptanceSchedule(gamma, maximum=maximum)
    return FixedLength(gamma)
