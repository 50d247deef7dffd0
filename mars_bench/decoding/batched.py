"""Batched decoding: ``decode_batch`` decodes B prompts together in the one engine (``decoding/engine.py``),
where ``decode`` is its batch of one. Kept as the import path its callers use."""

from mars_bench.decoding.engine import _Batch, decode_batch

__all__ = ["_Batch", "decode_batch"]
