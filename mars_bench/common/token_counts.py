"""What a decode's token counts mean. Torch-free, so that the analysis of records, the engine's tallies
and the perf suite count alike without importing torch."""

from __future__ import annotations

from typing import TypeVar

Count = TypeVar("Count")  # an int, or a pandas Series / numpy array of them

PREFILL_TOKENS = 1  # the prefill forward emits the first new token; every later one comes from a verification step


def emitted_tokens(new_tokens: Count) -> Count:
    """The new tokens the verification steps produced (all but the prefill's; 0 for a decode of none):
    the numerator of tau, whose denominator is the verification steps."""
    emitted = new_tokens - PREFILL_TOKENS
    return emitted.clip(0, None) if hasattr(emitted, "clip") else max(emitted, 0)
