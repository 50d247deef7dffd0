"""Verifiers: pure tensor functions registered by name (see DESIGN.md section 2).

from mars_bench.verification import VerifyInput, get_verifier
verdict = get_verifier("mars", theta=0.9).verify(step, generator=generator)
"""

from mars_bench.verification import mars, mars_ref, strict, typical  # noqa: F401  (registration)
from mars_bench.verification.base import (
    Decisions,
    Reason,
    Verdict,
    Verifier,
    VerifyInput,
    available_verifiers,
    get_verifier,
    register_verifier,
)

__all__ = [
    "Decisions",
    "Reason",
    "Verdict",
    "Verifier",
    "VerifyInput",
    "available_verifiers",
    "get_verifier",
    "register_verifier",
]
