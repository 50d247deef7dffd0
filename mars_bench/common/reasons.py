"""Reason codes: why a drafted node was accepted or rejected at a visited depth.

Torch-free, so that code reading records (analysis, reports) can decode the codes without
importing torch. ``mars_bench.verification`` re-exports ``Reason``.
"""

from __future__ import annotations

from enum import IntEnum


class Reason(IntEnum):
    """Why a drafted node was accepted or rejected at a visited depth."""

    EXACT = 0  # the target's own choice (argmax in greedy, the strict rule otherwise)
    RELAXED = 1  # accepted only because of a lossy rule's relaxation
    SAMPLED = 2  # accepted by a random acceptance test (min(1, p/q))
    REJECTED = 3
