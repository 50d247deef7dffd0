"""mars_bench: a benchmarking harness for speculative decoding with swappable verifiers.

The Python API in one call::

    from mars_bench import decode, get_verifier
    result = decode(target_model, drafter, get_verifier("mars", theta=0.9), prompt_ids,
                    max_new_tokens=128, temperature=1.0)
    result.tokens, result.tau, result.steps
"""

from mars_bench.decoding import DecodeResult, StepRecord, decode
from mars_bench.drafting import available_drafters, build_drafter
from mars_bench.verification import VerifyInput, available_verifiers, get_verifier

__all__ = [
    "DecodeResult",
    "StepRecord",
    "VerifyInput",
    "available_drafters",
    "available_verifiers",
    "build_drafter",
    "decode",
    "get_verifier",
]
__version__ = "0.1.0"
