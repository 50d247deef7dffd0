"""mars_bench: a benchmarking harness for speculative decoding with swappable verifiers.

The Python API in one call::

    from mars_bench import decode, get_verifier
    result = decode(target_model, drafter, get_verifier("mars", theta=0.9), prompt_ids,
                    max_new_tokens=128, temperature=1.0)
    result.tokens, result.tau, result.steps

Names are imported on first use, so that reading records (``mars_bench.bench.records``,
``mars_bench.bench.stats``) never imports torch.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

# transformers imports torchao (drafter.weights) whenever it is installed, and torchao's import
# logs a warning per CUDA extension this build lacks and per enum it registers with torch's
# pytree: lines on every run that say nothing about it. Errors still show.
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)

_EXPORTS = {
    "DecodeResult": "mars_bench.decoding",
    "StepRecord": "mars_bench.decoding",
    "decode": "mars_bench.decoding",
    "available_drafters": "mars_bench.drafting",
    "build_drafter": "mars_bench.drafting",
    "VerifyInput": "mars_bench.verification",
    "available_verifiers": "mars_bench.verification",
    "get_verifier": "mars_bench.verification",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mars_bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
