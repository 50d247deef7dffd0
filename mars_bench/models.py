"""Load targets and drafters (dtype, device_map sharding) and check tokenizer compatibility."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mars_bench.sources import ResolvedModel, resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is invalid: allowed are {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    resolved: ResolvedModel
    dtype: str

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device


def load_model(
    name: str,
    *,
    dtype: str = "bfloat16",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Resolve ``name`` (folder or Hub id) and load it for inference (eval mode, no grad)."""
    torch_dtype = parse_dtype(dtype)
    resolved = resolve_model(name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": torch_dtype, "attn_implementation": attn_implementation}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if max_memory is not None:
        kwargs["max_memory"] = max_memory
    model = AutoModelForCausalLM.from_pretrained(resolved.path, **kwargs)
    model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    return LoadedModel(model, tokenizer, resolved, dtype)


def check_tokenizers_compatible(target: Any, drafter: Any) -> None:
    """Raise ValueError unless both tokenizers map every token string to the same id."""
    target_vocab, drafter_vocab = target.get_vocab(), drafter.get_vocab()
    if target_vocab == drafter_vocab:
        return
    differing = sorted(set(target_vocab.items()) ^ set(drafter_vocab.items()), key=lambda item: item[1])[:3]
    raise ValueError(
        f"incompatible tokenizers: target has {len(target_vocab)} tokens, drafter {len(drafter_vocab)}, "
        f"first differences {differing}; allowed are drafters whose vocabulary equals the target's"
    )


def stop_token_ids(loaded: LoadedModel) -> list[int]:
    """EOS ids from the generation config and the tokenizer (chat end-of-turn included)."""
    ids: set[int] = set()
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    for marker in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        token_id = loaded.tokenizer.get_vocab().get(marker)
        if token_id is not None:
            ids.add(token_id)
    return sorted(ids)


def chat_prompt_ids(
    tokenizer: Any, turns: list[str] | list[dict[str, str]], system_prompt: str | None = None, **template_kwargs: Any
) -> list[int]:
    """Token ids of a chat prompt ending in the assistant's generation prompt.

    ``turns``: user messages (strings) or whole chat messages ({"role", "content"} dicts).
    ``template_kwargs`` go to the chat template (e.g. enable_thinking=False for Qwen3).
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [turn if isinstance(turn, dict) else {"role": "user", "content": turn} for turn in turns]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
