"""transformers' own decoding on models loaded as its users load them, configured to match ours
token for token where it can."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from mars_bench.models.placement import input_device, parse_dtype

PEER_LOADING = "AutoModelForCausalLM.from_pretrained(path, dtype={dtype}).eval()"


def load_peer(path: Any, dtype: str) -> Any:
    """A model exactly as a transformers user loads it: ``from_pretrained(path, dtype=...).eval()``
    and nothing else. Our own loader also turns gradients off (``requires_grad_(False)``), which
    sends transformers' multi-token forwards (assisted verification, the assistant catching up)
    down a slow path on CPU: measured, assisted generation ran at 3.6-4.2 tok/s on such models
    against 6.3-6.6 tok/s on a plain load."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype)).eval()


def peer_generation_config(max_new_tokens: int, temperature: float, stop_ids: list[int], pad_id: int) -> GenerationConfig:
    """Plain greedy or pure sampling (no top-k, top-p or repetition penalty: the model's own
    generation_config may set them, and ours does not use them)."""
    sampled = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        temperature=temperature if sampled else None,
        top_k=0 if sampled else None,
        top_p=1.0 if sampled else None,
        repetition_penalty=1.0,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )


@torch.inference_mode()
def peer_generate(
    target: Any, prompt: list[int], config: GenerationConfig, assistant: Any = None, seed: int = 0
) -> list[int]:
    """New token ids from ``target.generate`` (assisted when ``assistant`` is a model)."""
    device = input_device(target)
    ids = torch.tensor([prompt], device=device)
    torch.manual_seed(seed)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, assistant_model=assistant)
    return out[0, len(prompt) :].tolist()


def assistant_settings(assistant: Any) -> dict[str, Any]:
    """The assisted-generation settings transformers will use: the assistant's own, else its defaults."""
    defaults = GenerationConfig._get_default_generation_params()
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {key: getattr(assistant.generation_config, key, None) or defaults[key] for key in keys}
