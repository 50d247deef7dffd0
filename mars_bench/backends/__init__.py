"""Backends: what runs a method on a batch of prompts and returns each request's tokens, timings and
step trace. The cell (``bench/``) knows a backend only through ``Backend`` (``base.py``) and the
name records carry in their ``backend`` field; ``transformers`` (``hf.py``) is this package's engine,
``vllm`` (``vllm.py``) vLLM's offline engine with this package's verifiers deciding acceptance.

A backend registers a factory by name (``register_backend``); ``backend=NAME`` chooses it."""

from mars_bench.backends.base import (
    Backend,
    PreparedMethod,
    Requests,
    available_backends,
    check_backend,
    check_backend_config,
    make_backend,
    register_backend,
)
from mars_bench.backends.hf import TransformersBackend
from mars_bench.backends.vllm import VllmBackend, check_vllm_config

register_backend(TransformersBackend.name, TransformersBackend)
register_backend(VllmBackend.name, VllmBackend, check_vllm_config)

__all__ = [
    "Backend",
    "PreparedMethod",
    "Requests",
    "TransformersBackend",
    "VllmBackend",
    "available_backends",
    "check_backend",
    "check_backend_config",
    "make_backend",
    "register_backend",
]
