"""Self-drafting with the target's first N decoder layers, its final norm and its head.

The drafter is a real ``*ForCausalLM`` of the target's class, built on the meta device
and grafted with the target's own modules, so it allocates no weights, keeps its own KV
cache, and behaves like the target in every call (cache, masks, position ids, crop).
It must never be asked for hidden states: that would install a second set of capture
hooks on the shared layers and corrupt the target's (see reference/transformers-5.md).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mars_bench.drafting.base import register_drafter
from mars_bench.drafting.model import ModelDrafter


def truncated_model(target: Any, num_layers: int) -> Any:
    """A causal LM sharing ``target``'s embeddings, first ``num_layers`` layers, norm and head."""
    total = target.config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers < total:
        raise ValueError(f"layers={num_layers!r} is invalid: allowed is an integer in [1, {total - 1}] for this target")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        shell = type(target)(config)
    shell.model.embed_tokens = target.model.embed_tokens
    shell.model.layers = torch.nn.ModuleList(target.model.layers[:num_layers])
    shell.model.norm = target.model.norm
    shell.model.rotary_emb = target.model.rotary_emb
    shell.lm_head = target.lm_head
    shell.config._attn_implementation = target.config._attn_implementation
    return shell.eval()


@register_drafter("layerskip")
def layerskip_drafter(
    target: Any, layers: int | None = None, min_confidence: float | None = None, **_: object
) -> ModelDrafter:
    """Default depth: a quarter of the target's layers (at least 1)."""
    if layers is None:
        layers = max(1, target.config.num_hidden_layers // 4)
    drafter = ModelDrafter(truncated_model(target, layers), vocab_size=target.config.vocab_size, min_confidence=min_confidence)
    drafter.name = "layerskip"
    return drafter
