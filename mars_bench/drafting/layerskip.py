"""Self-drafting with the target's first N decoder layers, its final norm and its head.

The drafter is a real ``*ForCausalLM`` of the target's class, built on the meta device
and grafted with the target's own modules, so it allocates no weights, keeps its own KV
cache, and behaves like the target in every call (cache, masks, position ids, crop).
It must never be asked for hidden states: transformers 5 captures them with forward hooks
on the decoder layers, installed on first use, so the drafter would install a second set on
the shared layers and every later capture of the target's would hold extra, shifted entries.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.drafting.base import DrafterContext, register_drafter
from mars_bench.drafting.model import ModelDrafter
from mars_bench.drafting.stop import DraftStop


@dataclass(frozen=True)
class LayerSkipSettings:
    """layers: the target's first ``layers`` decoder layers draft; None: a quarter of them
    (at least 1). The upper bound (the target's layer count - 1) is checked when built."""

    layers: int | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and (isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1):
            raise ValueError(
                f"drafter.layers={self.layers!r} is invalid: allowed is an integer >= 1 or null (a quarter of the target's)"
            )


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


class LayerSkipDrafter(ModelDrafter):
    """A ``ModelDrafter`` over ``truncated_model(target, settings.layers)``; ``settings.layers``
    is the depth in use (a default resolved against the target)."""

    name = "layerskip"

    def __init__(self, target: Any, settings: LayerSkipSettings, stop: DraftStop | None = None) -> None:
        layers = settings.layers if settings.layers is not None else max(1, target.config.num_hidden_layers // 4)
        super().__init__(truncated_model(target, layers), vocab_size=target.config.vocab_size, stop=stop)
        self.settings = LayerSkipSettings(layers)


@register_drafter("layerskip", settings=LayerSkipSettings, stops=True)
def layerskip_drafter(settings: LayerSkipSettings, context: DrafterContext) -> LayerSkipDrafter:
    if context.target is None:
        raise ValueError("drafter 'layerskip' needs target=the target model: allowed is a drafter built for a target")
    return LayerSkipDrafter(context.target, settings, context.stop)
