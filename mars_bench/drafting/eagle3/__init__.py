"""EAGLE-3: a published draft head and the ``eagle3`` drafter, which grows EAGLE-2 style trees
with it. ``head``: the head's layers; ``checkpoint``: the key-to-shape table, its checks and
loading; ``drafter``: the drafter. What the published heads are, with sources: docs/eagle3.md."""

from importlib import import_module
from typing import Any

from mars_bench.drafting.eagle3.drafter import Eagle3Drafter, Eagle3Settings

# Imported when first asked for: the head's layers are transformers' Llama modules, whose import (2-3 s of the
# app's 5-6 s start on the 2-core CPU, before) only a run that drafts with EAGLE-3 needs.
_LAZY = {"eagle3_head_from_state": "checkpoint", "head_shapes": "checkpoint", "load_eagle3_head": "checkpoint",
         "random_head_state": "checkpoint", "Eagle3Head": "head", "eagle3_hidden_layers": "head"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"mars_bench.drafting.eagle3.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3Settings",
    "eagle3_head_from_state",
    "eagle3_hidden_layers",
    "head_shapes",
    "load_eagle3_head",
    "random_head_state",
]
