"""When a drafter ends a draft early: stop rules asked after each drafted token.

A stop rule sees the draft probabilities q of the tokens drafted so far in this step and says
whether to draft one more (the step's maximum still bounds the draft). It decides from the
tokens and their q alone, never from timings or from how the drafter computed them (lookup
guesses included), so a seeded run drafts the same tokens every time.

- ``ConfidenceStop`` (``drafter.length=confidence``): end after a token with q below a threshold.
- ``GainStop`` (``drafter.length=gain``): draft one more token while the tokens it is expected to
  add pay for what it costs, at the rate this sequence has earned tokens so far. What a q is
  worth in accepted tokens is learned from the sequence's own verdicts.

Each sequence starts from a fresh rule (``fresh``); the drafter reports each step's verdict
(``verdict``), which is how ``GainStop`` learns.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mars_bench.verification.base import check_range

CALIBRATION_BINS = 10  # GainStop's acceptance estimate per q in [0, 0.1), ..., [0.9, 1]
PRIOR_WEIGHT = 2.0  # pseudo-verdicts per bin that say "a token with draft probability q is kept with probability q"


def check_min_confidence(value: float | None) -> None:
    """A ``min_confidence`` is None or a probability in (0, 1)."""
    if value is not None and not 0 < value < 1:
        raise ValueError(f"drafter.min_confidence={value} is invalid: allowed is a number in (0, 1) or null")


def check_draft_cost(value: float) -> None:
    """A ``draft_cost`` is a finite number > 0 (in target forwards)."""
    smallest = math.nextafter(0.0, 1.0)
    check_range("drafter.draft_cost", value, smallest, math.inf, "a number > 0 (one drafted token's cost in target forwards)")


class DraftStop:
    """A per-sequence stop rule (the base never stops: the draft runs to the step's maximum)."""

    def fresh(self) -> DraftStop:
        """The same rule with nothing learned: one per sequence (the batched drafter keeps one per row)."""
        return dataclasses.replace(self) if dataclasses.is_dataclass(self) else type(self)()

    def keep_drafting(self, probs: list[float]) -> bool:
        """Whether to draft another token after drafting tokens with these q (non-empty, in order)."""
        return True

    def verdict(self, probs: list[float], accepted: int) -> None:
        """The step drafted tokens with these q (empty: it drafted none) and the verifier kept ``accepted``."""


@dataclass
class ConfidenceStop(DraftStop):
    """End the draft after a token the drafter gives q below ``min_confidence``."""

    min_confidence: float

    def __post_init__(self) -> None:
        check_min_confidence(self.min_confidence)

    def keep_drafting(self, probs: list[float]) -> bool:
        return probs[-1] >= self.min_confidence


@dataclass
class GainStop(DraftStop):
    """Draft one more token while its expected gain pays for its cost.

    draft_cost: one more drafted token's cost in target forwards (a drafter forward plus what one
        more token adds to the verifying forward), e.g. (28.4 + 1.3) ms / 182.8 ms = 0.16 for the
        embedded pair's int4 drafter on the reference CPU.

    The step's first draft is always made. After drafts with q_1..q_k, another draft is kept only
    if every draft so far is (probability a(q_1)...a(q_k)) and it is too (estimated a(q_k):
    confident runs go on), so it adds a(q_1)...a(q_k) a(q_k) tokens in expectation. It is drafted
    while that is at least ``draft_cost`` times the sequence's rate: the tokens its steps have
    committed per target forward of cost (each step one verify plus draft_cost per drafted token;
    one autoregressive step as the prior). a(q) is the share of tokens with a q in q's tenth that
    the verifier kept in this sequence, with ``PRIOR_WEIGHT`` pseudo-verdicts of probability q: a
    token counts as kept or as the first rejected; those after a rejection were never judged.
    """

    draft_cost: float
    kept: list[float] = field(init=False, repr=False)
    judged: list[float] = field(init=False, repr=False)
    committed: float = field(init=False, repr=False)
    spent: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_draft_cost(self.draft_cost)
        self.kept, self.judged = [0.0] * CALIBRATION_BINS, [0.0] * CALIBRATION_BINS
        self.committed, self.spent = 1.0, 1.0

    @staticmethod
    def _bin(q: float) -> int:
        return min(int(q * CALIBRATION_BINS), CALIBRATION_BINS - 1)

    def acceptance(self, q: float) -> float:
        """The estimated probability that a draft with draft probability q is kept."""
        index = self._bin(q)
        return (PRIOR_WEIGHT * q + self.kept[index]) / (PRIOR_WEIGHT + self.judged[index])

    @property
    def rate(self) -> float:
        """Tokens committed per target forward of cost so far in this sequence."""
        return self.committed / self.spent

    def keep_drafting(self, probs: list[float]) -> bool:
        reach = math.prod(self.acceptance(q) for q in probs)
        return reach * self.acceptance(probs[-1]) >= self.draft_cost * self.rate

    def verdict(self, probs: list[float], accepted: int) -> None:
        for position, q in enumerate(probs[: accepted + 1]):
            index = self._bin(q)
            self.judged[index] += 1.0
            self.kept[index] += float(position < accepted)
        self.committed += accepted + 1
        self.spent += 1.0 + self.draft_cost * len(probs)
