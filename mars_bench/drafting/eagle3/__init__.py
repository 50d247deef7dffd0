"""EAGLE-3: a published draft head and the ``eagle3`` drafter, which grows EAGLE-2 style trees
with it. ``head``: the head's layers; ``checkpoint``: the key-to-shape table, its checks and
loading; ``drafter``: the drafter. What the published heads are, with sources: docs/eagle3.md."""

from mars_bench.drafting.eagle3.checkpoint import eagle3_head_from_state, head_shapes, load_eagle3_head, random_head_state
from mars_bench.drafting.eagle3.drafter import Eagle3Drafter, Eagle3Settings
from mars_bench.drafting.eagle3.head import Eagle3Head, eagle3_hidden_layers

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
