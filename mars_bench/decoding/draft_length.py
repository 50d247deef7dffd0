"""Draft-length policies: how many tokens to ask the drafter for at the next step.

``fixed`` always asks for gamma. ``schedule`` adapts to recent acceptance: one more after a
step that kept every draft, one fewer after a step that rejected one (between ``minimum``
and ``maximum``). ``confidence`` and ``gain`` ask for gamma too, and the drafter may end the draft
early by a stop rule (``drafting/stop.py``: a threshold on the drafter's own probability of its
token, or the expected gain of one more draft against its cost), since only the drafter sees
those probabilities while it drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mars_bench.drafting.stop import ConfidenceStop, DraftStop, GainStop

LENGTH_POLICIES = ("fixed", "schedule", "confidence", "gain")


@dataclass(frozen=True)
class DraftLengthSettings:
    """How many drafts a step asks for: the one home of these keys' defaults (the app's ``drafter.*``
    keys, the perf suite and the lm-eval model take them from here).

    length: the policy, fixed | schedule | confidence | gain. gamma: drafts per step (a tree's depth);
    under ``schedule`` the first step's, adapted between 1 and ``max_gamma``. min_confidence: under
    ``confidence``, the drafter ends a draft after a token it gives q below this. draft_cost: under
    ``gain``, one more drafted token's cost in target forwards (``GainStop``).
    """

    length: str = "fixed"
    gamma: int = 5
    max_gamma: int = 16
    min_confidence: float = 0.4
    draft_cost: float = 0.15

    def draft_stop(self) -> DraftStop | None:
        """The drafter's stop rule: ``ConfidenceStop`` under ``confidence``, ``GainStop`` under ``gain``,
        None (draft to the step's maximum) under the others."""
        if self.length == "confidence":
            return ConfidenceStop(self.min_confidence)
        if self.length == "gain":
            return GainStop(self.draft_cost)
        return None


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
    """A fresh policy for one sequence. ``confidence`` and ``gain`` draft up to gamma per step; the drafter stops early."""
    if name not in LENGTH_POLICIES:
        raise ValueError(f"drafter.length={name!r} is invalid: allowed are {', '.join(LENGTH_POLICIES)}")
    if name == "schedule":
        if maximum < gamma:
            raise ValueError(f"drafter.max_gamma={maximum} is invalid: allowed is an integer >= gamma ({gamma})")
        return AcceptanceSchedule(gamma, maximum=maximum)
    return FixedLength(gamma)
