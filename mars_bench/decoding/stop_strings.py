"""Stop strings: end decoding once the decoded text contains one of them.

lm-eval's generative tasks stop at strings (``until``), not token ids. ``StopStrings`` is the
engine's ``stop_when`` check for them: after every step it decodes the new tokens and looks for
each string, so decoding ends at most one step (its accepted drafts and the next token) past the
step where a stop string appeared, instead of running to the token budget. The text is searched
whole, as the final cut at the first stop string searches it, so the check and the cut agree; on a
budget of a few hundred tokens decoding and searching it takes well under a millisecond a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopStrings:
    """tokenizer: the target's (decodes with ``skip_special_tokens=True``, as the answer is decoded);
    strings: the stop strings (empty ones are ignored, as lm-eval ignores them)."""

    tokenizer: Any
    strings: tuple[str, ...]

    def __call__(self, tokens: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return any(stop in text for stop in self.strings if stop)
