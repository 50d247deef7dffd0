"""Draft-length policies: how many tokens to ask the drafter for at the next step.

``fixed`` always asks for gamma. ``schedule`` adapts to recent acceptance: one more after a
step that kept every draft, one fewer after a step that rejected one (between ``minimum``
and ``maximum``). A confidence stop (drafting ends once the drafter's own probability of its
token falls below a threshold) lives in the drafter (``ModelDrafter(min_confidence=...)``),
since only the drafter sees that probability while it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    maximum: int = 16

    def next(self) -> int:
        return self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        step = 1 if accepted == drafted else -1
        self.gamma = max(self.minimum, min(self.maximum, self.gamma + step))


LENGTH_POLICIES = ("fixed", "schedule", "confidence")


def confidence_stop(length: str, min_confidence: float | None) -> float | None:
    """The draft probability q below which the drafter ends a draft: ``min_confidence`` under the
    ``confidence`` policy, None (never) under the others."""
    return min_confidence if length == "confidence" else None


def draft_length_policy(name: str, gamma: int, maximum: int = 16) -> DraftLength:
    """A fresh policy for one sequence. ``confidence`` drafts up to gamma per step; the drafter stops early."""
    if name not in LENGTH_POLICIES:
        raise ValueError(f"drafter.length={name!r} is invalid: allowed are {', '.join(LENGTH_POLICIES)}")
    if name == "schedule":
        if maximum < gamma:
            raise ValueError(f"drafter.max_gamma={maximum} is invalid: allowed is an integer >= gamma ({gamma})")
        return AcceptanceSchedule(gamma, maximum=maximum)
    return FixedLength(gamma)
