"""Shared fixtures: tiny random models (fp32) and the real SmolLM2-135M from its mirror."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def tiny_model(kind: str = "llama", seed: int = 0, layers: int = 4, vocab: int = 96):
    """A randomly initialised causal LM with peaked attention (initializer_range 0.2)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_class(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return model_class(config).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def smollm():
    from mars_bench.models import load_model

    return load_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype="float32")
