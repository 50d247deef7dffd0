"""Backends: what runs a method on a batch of prompts and returns each request's tokens, timings and
step trace. The cell (``bench/``) knows a backend only through ``Backend`` (``base.py``) and the
name records carry in their ``backend`` field; ``transformers`` (``hf.py``) is this package's engine.

A backend registers a factory by name (``register_backend``); ``backend=NAME`` chooses it."""

from mars_bench.backends.base import (
    Backend,
    PreparedMethod,
    Requests,
    available_backends,
    check_backend,
    make_backend,
    register_backend,
)
from mars_bench.backends.hf import TransformersBackend

register_backend(TransformersBackend.name, TransformersBackend)

__all__ = [
    "Backend",
    "PreparedMethod",
    "Requests",
    "TransformersBackend",
    "available_backends",
    "check_backend",
    "make_backend",
    "register_backend",
]
