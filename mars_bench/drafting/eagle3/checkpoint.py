"""A published EAGLE-3 head's checkpoint: the key-to-shape table, its checks, and loading.

``head_shapes`` is the one table of the official keys and their shapes; the loader checks a
checkpoint against it and ``random_head_state`` draws weights in it (a head with the
published layout for timing by shape and for tests). The layout's sources: ``docs/eagle3.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from mars_bench.drafting.eagle3.head import Eagle3Head
from mars_bench.models.placement import draft_head_device

VOCAB_MAP_KEYS = ("d2t", "t2d")  # optional only when draft_vocab_size == vocab_size
EMBED_KEY = "embed_tokens.weight"  # optional: the target's embeddings otherwise
REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
WEIGHT_PATTERNS = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]


def draft_vocab_size(config: dict[str, Any]) -> int:
    """The head's draft vocabulary size (``draft_vocab_size``, else the full ``vocab_size``)."""
    return int(config.get("draft_vocab_size") or config["vocab_size"])


def head_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every official state-dict key of the head of ``config`` (a config.json dict) with its shape.

    H = hidden_size, D = head_dim (default H / heads), kv = num_key_value_heads (default heads),
    I = intermediate_size, F = 3 x target_hidden_size (default 3H), V = vocab_size,
    Vd = draft_vocab_size (default V). ``optional_keys`` names the keys a checkpoint may omit.
    """
    hidden, heads, inter = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["intermediate_size"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab, draft_vocab = int(config["vocab_size"]), draft_vocab_size(config)
    features = 3 * int(config.get("target_hidden_size") or hidden)
    return {
        "fc.weight": (hidden, features),
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
        "t2d": (vocab,),
        EMBED_KEY: (vocab, hidden),
    }


def optional_keys(config: dict[str, Any]) -> set[str]:
    """The keys of ``head_shapes`` a checkpoint may omit: the embeddings (the target's are used),
    and the vocabulary map when the draft vocabulary is the full one."""
    full = draft_vocab_size(config) == int(config["vocab_size"])
    return {EMBED_KEY} | (set(VOCAB_MAP_KEYS) if full else set())


def random_head_state(
    config: dict[str, Any], seed: int = 0, device: torch.device | str = "cpu", scale: float = 0.2
) -> dict[str, torch.Tensor]:
    """Random weights in ``head_shapes(config)`` (no embeddings): matrices ~ N(0, scale^2), norm
    weights ~ 1 + N(0, 0.01), and d2t/t2d for a random sorted draft vocabulary. Drafting costs
    depend on shapes only, so this head times like a published one."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes = head_shapes(config)
    vocab, draft_vocab = shapes["t2d"][0], shapes["d2t"][0]
    used = torch.randperm(vocab, generator=generator, device=device)[:draft_vocab].sort().values
    state = {}
    for key, shape in shapes.items():
        if key in (*VOCAB_MAP_KEYS, EMBED_KEY):
            continue
        noise = torch.randn(shape, generator=generator, device=device)
        state[key] = 1 + 0.1 * noise if len(shape) == 1 else noise * scale
    state["d2t"] = used - torch.arange(draft_vocab, device=device)
    state["t2d"] = torch.isin(torch.arange(vocab, device=device), used)
    return state


def target_sizes(target: Any) -> tuple[int, int]:
    """The target's (hidden_size, vocab_size), from its text config."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return int(config.hidden_size), int(config.vocab_size)


def _listed(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def check_head_config(config: dict[str, Any], target: Any, source: str) -> None:
    """A one-line ValueError unless ``config`` describes a one-layer head trained for ``target``."""
    for field in REQUIRED_FIELDS:
        if field not in config:
            raise ValueError(f"eagle3 head {source} config.json lacks {field}: allowed is a config.json of an EAGLE-3 head")
    layers = config.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"eagle3 head {source} num_hidden_layers={layers} is not supported: allowed is 1 (the published layout)")
    target_hidden, target_vocab = target_sizes(target)
    feature_hidden = int(config.get("target_hidden_size") or config["hidden_size"])
    if feature_hidden != target_hidden:
        field = "target_hidden_size" if "target_hidden_size" in config else "hidden_size"
        raise ValueError(
            f"eagle3 head {source} {field}={feature_hidden} does not match the target's hidden_size={target_hidden}: "
            "allowed is a head trained for this target"
        )
    if int(config["vocab_size"]) != target_vocab:
        raise ValueError(
            f"eagle3 head {source} vocab_size={config['vocab_size']} does not match the target's vocab_size={target_vocab}: "
            "allowed is a head trained for this target"
        )


def check_head_state(config: dict[str, Any], state: dict[str, torch.Tensor], target: Any, source: str) -> None:
    """A one-line ValueError unless ``state`` has exactly the table's keys and shapes (optional
    keys may be absent), a one-to-one d2t into the target's vocabulary, and embeddings of its
    own when its hidden size differs from the target's."""
    expected, optional = head_shapes(config), optional_keys(config)
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
    target_hidden, target_vocab = target_sizes(target)
    target_ids = _target_ids(config, state)
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= target_vocab:
        raise ValueError(
            f"eagle3 head {source} d2t maps draft ids to target ids in [{low}, {high}]: "
            f"allowed is the target vocabulary [0, {target_vocab - 1}]"
        )
    if torch.unique(target_ids).numel() != target_ids.numel():
        raise ValueError(f"eagle3 head {source} d2t maps several draft ids to one target id: allowed is a one-to-one map")
    hidden = int(config["hidden_size"])
    if EMBED_KEY not in state and hidden != target_hidden:
        raise ValueError(
            f"eagle3 head {source} hidden_size={hidden} differs from the target's {target_hidden} and has no {EMBED_KEY}: "
            "allowed is a head whose embeddings are in its checkpoint or match the target's"
        )


def _target_ids(config: dict[str, Any], state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target id of each draft id (CPU LongTensor[Vd]): draft_id + d2t[draft_id]."""
    draft_vocab = draft_vocab_size(config)
    d2t = state.get("d2t", torch.zeros(draft_vocab, dtype=torch.long)).long().cpu()
    return torch.arange(draft_vocab) + d2t


def eagle3_head_from_state(
    config_dict: dict[str, Any],
    state: dict[str, torch.Tensor],
    target: Any,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    source: str = "(in memory)",
) -> Eagle3Head:
    """Check and build a head from a config.json dict and a state dict with the official keys.

    dtype: default the target's; device: default beside the target's lm_head (``draft_head_device``).
    """
    check_head_config(config_dict, target, source)
    check_head_state(config_dict, state, target, source)
    own_embed = EMBED_KEY in state
    with torch.device("meta"):  # no memory and no random init for weights about to be replaced
        head = Eagle3Head(
            LlamaConfig.from_dict(config_dict),
            head_shapes(config_dict)["fc.weight"][1],
            draft_vocab_size(config_dict),
            shared_embed=None if own_embed else target.get_input_embeddings(),
            own_embed=own_embed,
            aux_layer_ids=(config_dict.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
        )
    target_ids = _target_ids(config_dict, state)
    t2d = torch.zeros(target_sizes(target)[1], dtype=torch.bool)
    t2d[target_ids] = True
    full = {**state, "d2t": target_ids - torch.arange(len(target_ids)), "t2d": state["t2d"].bool() if "t2d" in state else t2d}
    head.load_state_dict(full, strict=True, assign=True)
    device = draft_head_device(target) if device is None else device
    head = head.to(device=device, dtype=target.dtype if dtype is None else dtype).eval().requires_grad_(False)
    head.refresh_vocab_map()
    return head


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


def load_eagle3_head(
    name_or_folder: str | Path, target: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Eagle3Head:
    """Load a published EAGLE-3 head for ``target`` from a folder or a Hub id.

    Reads config.json and the weights (``*.safetensors``, else ``pytorch_model*.bin``) by the
    official key names. dtype: default the target's; device: default beside the target's
    lm_head. A Hub id is fetched with ``huggingface_hub.snapshot_download`` only when no such
    folder exists. Raises a one-line ValueError for a head that does not fit the target.
    """
    folder = _resolve_folder(name_or_folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"eagle3 head {name_or_folder} has no config.json: allowed is a folder with config.json and weights")
    config_dict = json.loads(config_path.read_text())
    return eagle3_head_from_state(config_dict, _read_state(folder), target, dtype, device, source=str(name_or_folder))
