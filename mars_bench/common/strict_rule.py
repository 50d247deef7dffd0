"""The strict rule: the lossless verifier of a decoding mode, against which every lossy rule is
measured. Torch-free, so that the analysis and the perf suite name it without importing torch."""

from __future__ import annotations


def strict_verifier(temperature: float) -> str:
    """``exact`` in greedy runs (temperature 0: the target's argmax), ``rejection`` when sampling
    (the target's own distribution): the registered verifier whose output is the target's."""
    return "rejection" if temperature > 0 else "exact"
