"""The EAGLE-3 draft head as published, and a drafter that grows EAGLE-2 style trees with it.

What the published heads are (read from public sources; paths are in the repositories named):

Checkpoint (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): ``config.json`` + ``pytorch_model.bin``
(``ea_model.py`` loads ``pytorch_model.bin``, else ``model.safetensors``). The Hub files were not
read here (no Hub access); the config fields are those of the Llama-3.1-8B EAGLE-3 config in
SpecForge ``configs/llama3-8B-eagle3.json`` and EAGLE ``eagle/traineagle3/config.json`` (the latter
with ``architectures: ["LlamaForCausalLM"]``): ``architectures: ["LlamaForCausalLMEagle3"]``,
``model_type: llama``, ``hidden_size 4096``, ``intermediate_size 14336``,
``num_attention_heads 32``, ``num_key_value_heads 8``, ``num_hidden_layers 1``,
``rms_norm_eps 1e-05``, ``hidden_act silu``, ``max_position_embeddings 2048``,
``vocab_size 128256``, ``draft_vocab_size 32000``, ``torch_dtype float16``, ``pad_token_id 0``;
no ``rope_theta`` and no ``rope_scaling``, so RoPE base 10000 without scaling
(``eagle/model/cnets.py`` ``LlamaAttention._init_rope``: ``config.rope_theta`` when present, else
10000; it knows only ``linear``/``dynamic`` scaling). Other public heads (SpecForge configs for
Qwen3 and Llama-3.3-70B) add ``head_dim``, ``rope_theta`` and ``rope_scaling`` (``llama3``
type), and optionally ``target_hidden_size`` (``fc`` then takes ``3 * target_hidden_size``;
cnets.py and SGLang ``python/sglang/srt/models/llama_eagle3.py``) and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (SpecForge
``specforge/algorithms/model_providers.py``). Here the config is read as transformers'
``LlamaConfig`` reads it, which applies ``rope_theta``/``rope_scaling``/``head_dim`` as SGLang does.

Weights (official key names; module ``Model`` in ``eagle/model/cnets.py``, H = hidden_size,
D = head_dim, kv = num_key_value_heads, I = intermediate_size):
  fc.weight [H, 3H] (no bias)
  midlayer.self_attn.q_proj.weight [heads*D, 2H]; k_proj/v_proj.weight [kv*D, 2H];
  o_proj.weight [H, heads*D] (no biases)
  midlayer.mlp.gate_proj.weight / up_proj.weight [I, H]; down_proj.weight [H, I] (SiLU)
  midlayer.input_layernorm.weight / hidden_norm.weight / post_attention_layernorm.weight [H]
  norm.weight [H]; lm_head.weight [draft_vocab_size, H]
  d2t LongTensor[draft_vocab_size]; t2d BoolTensor[vocab_size]
``embed_tokens`` is not in the checkpoint: training freezes it and saves with
``exclude_frozen_parameters=True`` (``eagle/traineagle3/main.py``), and ``EaModel`` loads the
embeddings from the base model (``eagle/model/ea_model.py``, ``Model(..., load_emb=True)``).
When ``draft_vocab_size == vocab_size`` the official loader drops d2t/t2d
(``ea_model.py``: ``del self.ea_layer.d2t, self.ea_layer.t2d``, ``load_state_dict(strict=False)``).

Vocabulary map: ``d2t[i] = used_tokens[i] - i`` over the sorted ``used_tokens`` (the draft
vocabulary), ``t2d[t] = t in used_tokens`` (``eagle/traineagle3/cnets.py``), so
``target_id = draft_id + d2t[draft_id]`` (``cnets.py`` ``topK_genrate``:
``topk_index + self.d2t[topk_index]``; SGLang: ``hot_token_id = d2t + arange``). t2d is used
only in training; inference needs d2t alone.

Fused features: the target's modified forward collects the *input* of decoder layers
``idx == 2``, ``idx == N // 2`` and ``idx == N - 3`` (N = num_hidden_layers) in layer order
(``eagle/model/modeling_llama_kv.py``, the same in ``eagle/traineagle3/modeling_llama_kv.py``).
The input of decoder layer idx is transformers' ``output_hidden_states[idx]`` (index 0 = the
embedding output, index i = the output of decoder layer i - 1; the last index is post-norm and
never used), so the features are ``cat(hs[2], hs[N // 2], hs[N - 3])`` (for Llama-3.1-8B,
N = 32: 2, 16, 29). SpecForge states the same as decoder-layer ids ``[1, N // 2 - 1, N - 4]``
with "capture layer id L == hidden_states[L+1]" (``tests/test_runtime/test_server_capture_gate.py``).

The head's forward (``cnets.py`` ``Model.forward`` and ``LlamaDecoderLayeremb``):
  hidden = fc(features) when its width is 3H, else the head's own previous output (H wide)
  x = cat(input_layernorm(embed(token)), hidden_norm(hidden))        [n, 2H]
  hidden = hidden + o_proj(attention(q/k/v_proj(x)))                  residual = the un-normed hidden
  hidden = hidden + mlp(post_attention_layernorm(hidden))
  output hidden = hidden (fed to the next draft step); logits = lm_head(norm(hidden)) over the draft vocab.
The KV cache holds pairs (feature_i, token_{i+1}) at position i, one per committed token but the
newest. ``topK_genrate`` feeds the not-yet-fed pairs as a chain, takes the last output as the
root, then per depth feeds the top_k frontier nodes in one forward: token = the node's token,
hidden = its parent's output hidden, position = cache length + depth, attention = the whole
cache + the node's ancestors among earlier-fed nodes + itself; the tree nodes' KV is dropped
afterwards (``stable_kv`` keeps the committed part only). Drafting is top-k in greedy and
sampling mode; its scores are log-softmax of the head's logits.

Here: ``Eagle3Head`` (plain torch modules, transformers' Llama RoPE/RMSNorm helpers, its own
one-layer KV cache), ``load_eagle3_head`` (config.json + safetensors or pytorch_model.bin by the
official key names) and the registered ``eagle3`` drafter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

from mars_bench.drafting.base import Draft, Drafter, register_drafter
from mars_bench.drafting.tree import DraftTree, TreeShape, expand_tree, frontier_block
from mars_bench.models import input_device, output_device
from mars_bench.verification.sampling import SamplingParams

VOCAB_MAP_KEYS = ("d2t", "t2d")  # optional only when draft_vocab_size == vocab_size
EMBED_KEY = "embed_tokens.weight"  # optional: the target's embeddings otherwise
WEIGHT_PATTERNS = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]


def _listed(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


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
    """One EAGLE-3 draft head with its own KV cache (one layer: keys/values [1, kv, S, D]).

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
        """Keep the first ``length`` cached positions."""
        if self.keys is not None and length < self.cache_length:
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]

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
        """
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
        attn = self.midlayer.self_attn
        count, past = x.shape[0], self.cache_length
        q = attn.q_proj(x).view(1, count, attn.heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, count, attn.kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, count, attn.kv_heads, attn.head_dim).transpose(1, 2)
        rope = self._rope.module
        if rope is None or rope.inv_freq.device != x.device:
            with torch.device(x.device):
                rope = self._rope.module = LlamaRotaryEmbedding(self.config)
        cos, sin = rope(v, position_ids[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        total = past + count
        if attention is None:
            mask = torch.arange(total, device=x.device)[None] <= past + torch.arange(count, device=x.device)[:, None]
            mask = mask[None, None]
        elif attention.dtype == torch.bool:
            if tuple(attention.shape) != (count, total):
                raise ValueError(f"attention shape {tuple(attention.shape)} is invalid: allowed is ({count}, {total})")
            mask = attention.to(x.device)[None, None]
        else:
            if tuple(attention.shape) != (1, 1, count, total):
                raise ValueError(f"attention shape {tuple(attention.shape)} is invalid: allowed is (1, 1, {count}, {total})")
            mask = attention.to(x.device, q.dtype)
        groups = attn.heads // attn.kv_heads
        out = F.scaled_dot_product_attention(
            q, repeat_kv(self.keys, groups), repeat_kv(self.values, groups), attn_mask=mask, scale=attn.head_dim**-0.5
        )
        return attn.o_proj(out.transpose(1, 2).reshape(count, attn.heads * attn.head_dim))


# --- loading --------------------------------------------------------------------------------


def _resolve_folder(name_or_folder: str | Path) -> Path:
    local = Path(name_or_folder).expanduser()
    if local.is_dir():
        return local
    name = str(name_or_folder)
    parts = name.split("/")
    if len(parts) != 2 or not all(parts) or name.startswith((".", "/", "~")):
        raise ValueError(f"eagle3 head {name!r} is invalid: allowed is an existing folder or a Hub id of the form owner/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=WEIGHT_PATTERNS))
    except Exception as error:  # offline, unknown id, gated
        raise ValueError(
            f"eagle3 head {name!r} could not be fetched from the Hugging Face Hub ({type(error).__name__}): "
            "allowed is an existing folder or a reachable Hub id"
        ) from error


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(shard)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        state = {}
        for shard in bins:
            state.update(torch.load(shard, map_location="cpu", weights_only=True))
        return state
    raise ValueError(f"eagle3 head folder {folder} has no weights: allowed are *.safetensors or pytorch_model.bin")


def _target_sizes(target: Any) -> tuple[int, int]:
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return int(config.hidden_size), int(config.vocab_size)


def _check_keys(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], optional: set[str], source: str) -> None:
    missing = [key for key in expected if key not in state and key not in optional]
    if missing:
        raise ValueError(
            f"eagle3 head {source} is missing keys {_listed(missing)}: allowed is the official EAGLE-3 layout "
            "(fc, midlayer.*, norm, lm_head, d2t, t2d)"
        )
    extra = sorted(key for key in state if key not in expected)
    if extra:
        raise ValueError(
            f"eagle3 head {source} has unexpected keys {_listed(extra)}: allowed are only the official EAGLE-3 keys "
            "(fc, midlayer.*, norm, lm_head, d2t, t2d, optionally embed_tokens)"
        )
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != shape:
            raise ValueError(f"eagle3 head {source} key {key} has shape {list(state[key].shape)}: allowed is {list(shape)}")


def eagle3_head_from_state(
    config_dict: dict[str, Any],
    state: dict[str, torch.Tensor],
    target: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    source: str = "(in memory)",
) -> Eagle3Head:
    """Build and check a head from a config.json dict and a state dict with the official keys."""
    for field in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if field not in config_dict:
            raise ValueError(f"eagle3 head {source} config.json lacks {field}: allowed is a config.json of an EAGLE-3 head")
    layers = config_dict.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"eagle3 head {source} num_hidden_layers={layers} is not supported: allowed is 1 (the published layout)")
    config = LlamaConfig.from_dict(config_dict)
    target_hidden, target_vocab = _target_sizes(target)
    hidden = int(config.hidden_size)
    feature_hidden = int(config_dict.get("target_hidden_size") or hidden)
    if feature_hidden != target_hidden:
        field = "target_hidden_size" if "target_hidden_size" in config_dict else "hidden_size"
        raise ValueError(
            f"eagle3 head {source} {field}={feature_hidden} does not match the target's hidden_size={target_hidden}: "
            "allowed is a head trained for this target"
        )
    if int(config.vocab_size) != target_vocab:
        raise ValueError(
            f"eagle3 head {source} vocab_size={config.vocab_size} does not match the target's vocab_size={target_vocab}: "
            "allowed is a head trained for this target"
        )
    draft_vocab = int(config_dict.get("draft_vocab_size") or config.vocab_size)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    expected: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, 3 * feature_hidden),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (inter, hidden),
        "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "midlayer.input_layernorm.weight": (hidden,),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (int(config.vocab_size),),
        EMBED_KEY: (int(config.vocab_size), hidden),
    }
    optional = {EMBED_KEY} | (set(VOCAB_MAP_KEYS) if draft_vocab == config.vocab_size else set())
    _check_keys(state, expected, optional, source)
    d2t = state.get("d2t", torch.zeros(draft_vocab, dtype=torch.long)).long()
    target_ids = torch.arange(draft_vocab) + d2t.cpu()
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= target_vocab:
        raise ValueError(
            f"eagle3 head {source} d2t maps draft ids to target ids in [{low}, {high}]: "
            f"allowed is the target vocabulary [0, {target_vocab - 1}]"
        )
    if torch.unique(target_ids).numel() != draft_vocab:
        raise ValueError(f"eagle3 head {source} d2t maps several draft ids to one target id: allowed is a one-to-one map")
    if EMBED_KEY not in state and hidden != target_hidden:
        raise ValueError(
            f"eagle3 head {source} hidden_size={hidden} differs from the target's {target_hidden} and has no {EMBED_KEY}: "
            "allowed is a head whose embeddings are in its checkpoint or match the target's"
        )
    eagle_config = config_dict.get("eagle_config") or {}
    with torch.device("meta"):  # no memory and no random init for weights about to be replaced
        head = Eagle3Head(
            config,
            3 * feature_hidden,
            draft_vocab,
            shared_embed=None if EMBED_KEY in state else target.get_input_embeddings(),
            own_embed=EMBED_KEY in state,
            aux_layer_ids=eagle_config.get("eagle_aux_hidden_state_layer_ids"),
        )
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[target_ids] = True
    full = {**state, "d2t": d2t, "t2d": state["t2d"].bool() if "t2d" in state else t2d}
    head.load_state_dict(full, strict=True, assign=True)
    if dtype is None:
        dtype = target.dtype
    if device is None:
        device = output_device(target)
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.refresh_vocab_map()
    return head


def load_eagle3_head(
    name_or_folder: str | Path, target: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Eagle3Head:
    """Load a published EAGLE-3 head for ``target`` from a folder or a Hub id.

    Reads config.json and the weights (``*.safetensors``, else ``pytorch_model*.bin``) by the
    official key names. dtype: default the target's; device: default the device of the target's
    lm_head. A Hub id is fetched with ``huggingface_hub.snapshot_download`` only when no such
    folder exists. Raises a one-line ValueError for a head that does not fit the target.
    """
    folder = _resolve_folder(name_or_folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"eagle3 head {name_or_folder} has no config.json: allowed is a folder with config.json and weights")
    config_dict = json.loads(config_path.read_text())
    return eagle3_head_from_state(config_dict, _read_state(folder), target, dtype, device, source=str(name_or_folder))


# --- the drafter ----------------------------------------------------------------------------


class Eagle3Drafter(Drafter):
    """Drafts an EAGLE-2 style dynamic tree with an EAGLE-3 head.

    The head's cache holds one pair (feature_i, token_{i+1}) per committed token but the newest,
    at position i. Features arrive from the engine (``begin``: the prompt's rows; ``accept``: the
    root's and the accepted nodes' rows) and are fed lazily at the next ``propose``, as a chain;
    its last output is the root. The tree then grows depth by depth (``expand_tree``), each depth
    one head forward over the frontier, and its nodes leave the cache afterwards. Drafting is
    top-k (deterministic) at every temperature; ``probs`` is the head's softmax probability of
    each node's token given its parent.

    After each ``propose`` the full grown tree (before pruning to ``tree_tokens - 1`` nodes),
    the head's outputs of every fed node and the root's are kept for inspection:
    ``last_grown`` (DraftTree; empty when no tree node was fed), ``last_outputs``
    {node of last_grown: (draft logits [draft_vocab], hidden [H])}, ``last_root`` (draft logits, hidden).
    """

    name = "eagle3"

    def __init__(self, target: Any, head: Eagle3Head, top_k: int = 10, tree_tokens: int = 50, head_name: str | None = None):
        TreeShape(1, top_k, tree_tokens)  # checks top_k >= 1 and tree_tokens >= 2
        if top_k > head.draft_vocab_size:
            raise ValueError(
                f"drafter.top_k={top_k} is invalid for this head: allowed is at most its draft_vocab_size={head.draft_vocab_size}"
            )
        target_hidden, target_vocab = _target_sizes(target)
        if head.vocab_size != target_vocab:
            raise ValueError(
                f"eagle3 head vocab_size={head.vocab_size} does not match the target's vocab_size={target_vocab}: "
                "allowed is a head trained for this target"
            )
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.hidden_layers = eagle3_hidden_layers(int(config.num_hidden_layers), head.aux_layer_ids)
        if len(self.hidden_layers) * target_hidden != head.feature_size:
            raise ValueError(
                f"eagle3 head fc input width {head.feature_size} is invalid for this target: "
                f"allowed is {len(self.hidden_layers)} x hidden_size {target_hidden}"
            )
        self.head = head
        self.top_k = top_k
        self.tree_tokens = tree_tokens
        self.head_name = head_name
        self.vocab_size = target_vocab
        self.device = input_device(target)
        self.pending: torch.Tensor | None = None  # features not yet fed, for positions cache_length ...
        self.root: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (context length, logits, hidden)
        self.last_grown = DraftTree()
        self.last_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_root: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in begin: allowed is an engine that passes them")
        if features.shape[0] != prompt_ids.shape[0]:
            raise ValueError(f"features has {features.shape[0]} rows: allowed is one per prompt token ({prompt_ids.shape[0]})")
        self.head.reset()
        self.pending = features
        self.root = None

    def accept(self, path: list[int], features: torch.Tensor | None = None) -> None:
        if features is None:
            raise ValueError("eagle3 needs features=the target's hidden states in accept: allowed is an engine that passes them")
        if features.shape[0] != len(path) + 1:
            raise ValueError(f"features has {features.shape[0]} rows: allowed is len(path) + 1 = {len(path) + 1}")
        features = features.to(self.pending.device if self.pending is not None else features.device)
        self.pending = features if self.pending is None or self.pending.shape[0] == 0 else torch.cat([self.pending, features])

    def _feed_committed(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pairs not yet cached; the head's (draft logits, hidden) after the last context token."""
        head, total = self.head, int(context.shape[0])
        start = head.cache_length
        waiting = 0 if self.pending is None else int(self.pending.shape[0])
        if waiting != total - 1 - start:
            raise ValueError(
                f"eagle3 holds features for positions up to {start + waiting - 1} but the context has {total} tokens: "
                f"allowed is one feature row per committed token but the newest (rows up to {total - 2})"
            )
        if waiting == 0:
            if self.root is None or self.root[0] != total:
                raise ValueError(f"eagle3 has no features for a context of {total} tokens: allowed is a context after begin")
            return self.root[1], self.root[2]
        tokens = context[start + 1 : total].to(head.fc.weight.device)
        positions = torch.arange(start, total - 1, device=head.fc.weight.device)
        logits, hidden = head(tokens, self.pending, positions)
        self.pending = self.pending[:0]
        self.root = (total, logits[-1], hidden[-1])
        return logits[-1], hidden[-1]

    def propose(
        self,
        context: torch.Tensor,
        max_drafts: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        head = self.head
        root_logits, root_hidden = self._feed_committed(context)
        committed = head.cache_length
        fed: list[int] = []  # tree nodes in head-cache order after the committed pairs
        outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        grown: list[DraftTree] = []

        def next_logprobs(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
            grown[:] = [tree]
            tokens, positions, allowed = frontier_block(tree, frontier, fed, committed)
            device = head.fc.weight.device
            hidden_in = torch.stack([root_hidden if tree.parents[n] < 0 else outputs[tree.parents[n]][1] for n in frontier])
            logits, hidden = head(tokens.to(device), hidden_in, positions.to(device), allowed)
            for row, node in enumerate(frontier):
                outputs[node] = (logits[row], hidden[row])
            fed.extend(frontier)
            return head.target_logprobs(logits, self.vocab_size)

        root_logprobs = head.target_logprobs(root_logits[None], self.vocab_size)[0]
        tree = expand_tree(root_logprobs, next_logprobs, TreeShape.for_step(max_drafts, self.top_k, self.tree_tokens))
        head.truncate(committed)  # tree nodes leave the cache; committed pairs stay
        self.last_grown = grown[0] if grown else DraftTree()
        self.last_outputs = outputs
        self.last_root = (root_logits, root_hidden)
        return Draft(
            tokens=torch.tensor(tree.tokens, dtype=torch.long, device=self.device),
            probs=torch.tensor(tree.probs, dtype=torch.float32, device=self.device),
            dists=None,
            parents=torch.tensor(tree.parents, dtype=torch.long),
        )

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "head": self.head_name,
            "top_k": self.top_k,
            "tree_tokens": self.tree_tokens,
            "hidden_layers": list(self.hidden_layers),
            "draft_vocab_size": self.head.draft_vocab_size,
            "device": str(self.head.fc.weight.device),
        }


def random_head_state(
    config: dict[str, Any], seed: int = 0, device: torch.device | str = "cpu", scale: float = 0.2
) -> dict[str, torch.Tensor]:
    """Random weights under the official key names and shapes, and a d2t/t2d for a random sorted
    draft vocabulary: a head in the published layout for tests and timing checks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    vocab, draft_vocab = int(config["vocab_size"]), int(config["draft_vocab_size"])
    dim = hidden // heads

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * scale

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen, device=device)

    used = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab].sort().values
    return {
        "fc.weight": matrix(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": matrix(heads * dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": matrix(kv * dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": matrix(kv * dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": matrix(hidden, heads * dim),
        "midlayer.mlp.gate_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.up_proj.weight": matrix(inter, hidden),
        "midlayer.mlp.down_proj.weight": matrix(hidden, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": matrix(draft_vocab, hidden),
        "d2t": used - torch.arange(draft_vocab, device=device),
        "t2d": torch.isin(torch.arange(vocab, device=device), used),
    }


@register_drafter("eagle3")
def eagle3_drafter(
    target: Any, head: str | Path | Eagle3Head | None = None, top_k: int = 10, tree_tokens: int = 50, **_: object
) -> Eagle3Drafter:
    """head: a folder or Hub id of a published EAGLE-3 head, or an ``Eagle3Head``."""
    if head is None:
        raise ValueError(
            "drafter 'eagle3' got head=None: allowed is an EAGLE-3 head folder or Hub id (model.eagle3_head), or an Eagle3Head"
        )
    if isinstance(head, Eagle3Head):
        return Eagle3Drafter(target, head, top_k, tree_tokens, head_name=None)
    return Eagle3Drafter(target, load_eagle3_head(head, target), top_k, tree_tokens, head_name=str(head))
