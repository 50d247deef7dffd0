"""The EAGLE-3 draft head's layers, as published (one decoder layer fed by fused target
features; its own one-layer KV cache). Sources and the architecture in ``docs/eagle3.md``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv


def eagle3_hidden_layers(num_layers: int, aux_layer_ids: list[int] | None = None) -> tuple[int, ...]:
    """The ``output_hidden_states`` indices EAGLE-3 fuses for a target of ``num_layers`` layers.

    Default: the inputs of decoder layers 2, N // 2 and N - 3, low to high. ``aux_layer_ids``
    (a head config's ``eagle_config.eagle_aux_hidden_state_layer_ids``) name decoder-layer outputs,
    so index id + 1. For N in 4..6 default indices coincide (the official forward then collects
    fewer than three entries and its ``fc`` fails); here they are kept, so ``fc`` always sees three.
    """
    if aux_layer_ids is not None:
        layers = tuple(int(i) + 1 for i in aux_layer_ids)
    else:
        layers = tuple(sorted((2, num_layers // 2, num_layers - 3)))
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(
            f"EAGLE-3 hidden-state indices {layers} are invalid for a target with num_hidden_layers={num_layers}: "
            f"allowed are three indices in [0, {num_layers - 1}] (a target of at least 3 layers)"
        )
    return layers


class _Unregistered:
    """Holds a module outside the head's module tree, so that ``head.to()`` never touches it."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module


class _Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.heads
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Eagle3Head(nn.Module):
    """One EAGLE-3 draft head with its own KV cache (one layer: keys/values [B, kv, S, D], a row per sequence).

    config: the head's config.json read as a ``LlamaConfig``. feature_size: the width of the
    fused target features (3 x the target's hidden size). shared_embed: the target's input
    embedding, used (never moved or cast) unless ``own_embed`` is set, in which case the head
    has an ``embed_tokens`` of its own. ``forward`` returns draft-vocabulary logits;
    ``target_logprobs`` maps them to the target's vocabulary. State dict keys are the official
    ones (fc, midlayer.*, norm, lm_head, d2t, t2d; embed_tokens when the head has its own).
    After loading a state dict call ``refresh_vocab_map``.
    """

    def __init__(
        self,
        config: LlamaConfig,
        feature_size: int,
        draft_vocab_size: int,
        shared_embed: nn.Module | None = None,
        own_embed: bool = False,
        aux_layer_ids: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.draft_vocab_size = draft_vocab_size
        self.feature_size = feature_size
        self.aux_layer_ids = aux_layer_ids
        self.embed_tokens = nn.Embedding(self.vocab_size, self.hidden_size) if own_embed else None
        self._shared = _Unregistered(shared_embed)
        self.fc = nn.Linear(feature_size, self.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = LlamaRMSNorm(self.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(self.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        self.draft_ids = torch.arange(draft_vocab_size)  # the target id of each draft id
        # Built on first use on the head's device and kept out of the module tree, so that
        # ``.to(bfloat16)`` cannot round its fp32 inverse frequencies.
        self._rope = _Unregistered(None)
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    # --- vocabulary and embeddings -------------------------------------------------------

    def refresh_vocab_map(self) -> None:
        """Recompute the draft -> target id map from ``d2t`` (target_id = draft_id + d2t[draft_id])."""
        self.draft_ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t.long()

    def embed(self, input_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        module = self.embed_tokens if self.embed_tokens is not None else self._shared.module
        if module is None:
            raise ValueError("the EAGLE-3 head has no token embedding: allowed is a checkpoint with embed_tokens or a target's")
        return module(input_ids.to(module.weight.device)).to(like.device, like.dtype)

    def target_logprobs(self, logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """Log-softmax of draft logits [n, draft_vocab] placed in the target vocabulary [n, V]
        (-inf for target tokens outside the draft vocabulary)."""
        width = vocab_size or self.vocab_size
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = torch.full((logits.shape[0], width), float("-inf"), dtype=logprobs.dtype, device=logits.device)
        return out.index_copy_(1, self.draft_ids.to(logits.device), logprobs)

    # --- the KV cache ----------------------------------------------------------------------

    @property
    def cache_length(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    def reset(self) -> None:
        self.keys = self.values = None

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions (of every row)."""
        if self.keys is not None and length < self.cache_length:
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the cache rows ``rows`` (LongTensor) of a batch's cache."""
        if self.keys is not None:
            self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)

    # --- forward ---------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed n (hidden, token) pairs after the cache; returns (draft logits [n, draft_vocab], hidden [n, H]).

        input_ids: LongTensor[n], each pair's token. hidden: [n, feature_size] fused target
        features (``fc`` applies) or [n, H] the head's own outputs. position_ids: LongTensor[n].
        attention: None (causal: the whole cache and the earlier new pairs), a bool [n, S + n]
        (True = attend) or an additive float mask [1, 1, n, S + n], S = cache length before the call.
        The new pairs' keys and values are appended to the cache.

        A batch of B rows, each with its own cache row, passes a leading row axis: input_ids and
        position_ids [B, n], hidden [B, n, width], attention None or a bool [B, n, S + n] or an
        additive [B, 1, n, S + n]; the outputs are then [B, n, draft_vocab] and [B, n, H].
        """
        if input_ids.dim() == 2:
            return self._forward_rows(input_ids, hidden, position_ids, attention)
        count, total = input_ids.shape[0], self.cache_length + input_ids.shape[0]
        if attention is not None and attention.dtype == torch.bool:
            if tuple(attention.shape) != (count, total):
                raise ValueError(f"attention shape {tuple(attention.shape)} is invalid: allowed is ({count}, {total})")
            attention = attention[None]
        elif attention is not None and tuple(attention.shape) != (1, 1, count, total):
            raise ValueError(f"attention shape {tuple(attention.shape)} is invalid: allowed is (1, 1, {count}, {total})")
        logits, hidden = self._forward_rows(input_ids[None], hidden[None], position_ids[None], attention)
        return logits[0], hidden[0]

    def _forward_rows(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on a batch: input_ids, position_ids [B, n]; hidden [B, n, width]; attention as there."""
        weight = self.fc.weight
        hidden = hidden.to(weight.device, weight.dtype)
        if hidden.shape[-1] == self.feature_size and self.feature_size != self.hidden_size:
            hidden = self.fc(hidden)
        elif hidden.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden width {hidden.shape[-1]} is invalid: allowed are {self.feature_size} (fused target features) "
                f"or {self.hidden_size} (the head's own output)"
            )
        layer = self.midlayer
        embeds = self.embed(input_ids, hidden)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self._attend(x, position_ids.to(weight.device), attention)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.norm(hidden)), hidden

    def _attend(self, x: torch.Tensor, position_ids: torch.Tensor, attention: torch.Tensor | None) -> torch.Tensor:
        """Self-attention of x [B, n, 2H] over the cache and the new pairs; attention: None (causal), a bool
        [B, n, S + n] or an additive [B, 1, n, S + n] mask."""
        attn = self.midlayer.self_attn
        rows, count, past = x.shape[0], x.shape[1], self.cache_length
        q = attn.q_proj(x).view(rows, count, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(rows, count, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(rows, count, attn.kv_heads, attn.head_dim).transpose(1, 2)
        rope = self._rope.module
        if rope is None or rope.inv_freq.device != x.device:
            with torch.device(x.device):
                rope = self._rope.module = LlamaRotaryEmbedding(self.config)
        cos, sin = rope(v, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        total = past + count
        if attention is None:
            mask = torch.arange(total, device=x.device)[None] <= past + torch.arange(count, device=x.device)[:, None]
            mask = mask[None, None]
        elif attention.dtype == torch.bool:
            mask = attention.to(x.device)[:, None]
        else:
            mask = attention.to(x.device, q.dtype)
        groups = attn.heads // attn.kv_heads
        out = F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, groups), repeat_kv(self.values, groups), attn_mask=mask, scale=attn.head_dim**-0.5
        )
        return attn.o_proj(out.transpose(1, 2).reshape(rows, count, attn.heads * attn.head_dim))
