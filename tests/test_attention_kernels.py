"""The attention kernels a decode runs on (``loading.steady_attention_kernels``): on a machine without CUDA, SDPA
reads grouped-query attention's shared key and value heads as they are, with the same outputs as the copy."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_model
from transformers.integrations import sdpa_attention

from mars_bench.models.kvcache import BatchCache, cached_forward, crop_to, new_cache, padded_rows
from mars_bench.models.loading import SDPA_GQA, steady_attention_kernels

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only machine's setting")


def test_a_cpu_only_load_lets_sdpa_read_shared_heads_and_a_users_setting_wins(monkeypatch):
    model = tiny_model("qwen2")
    monkeypatch.setenv(SDPA_GQA, "")  # recorded first, so that the session's own value (or none) comes back after
    monkeypatch.delenv(SDPA_GQA)
    steady_attention_kernels(model)
    assert os.environ[SDPA_GQA] == "1"
    monkeypatch.setenv(SDPA_GQA, "0")
    steady_attention_kernels(model)
    assert os.environ[SDPA_GQA] == "0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_masked_forward_gives_the_same_logits_bit_for_bit_with_shared_heads_read_or_copied(monkeypatch, dtype):
    model = tiny_model("qwen2", layers=2).to(dtype)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    cache = new_cache(model)
    cached_forward(model, torch.arange(40) % 96, cache)
    copies = []
    copy = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda states, groups: copies.append(groups) or copy(states, groups))
    logits = {}
    for setting in ("0", "1"):  # 6 tokens after a cached prefix: transformers builds a causal mask
        monkeypatch.setenv(SDPA_GQA, setting)
        copies.clear()
        logits[setting] = cached_forward(model, torch.tensor([5, 6, 7, 8, 9, 10]), cache)[0]
        crop_to(cache, 40)
        assert bool(copies) == (setting == "0")  # the heads copied per query head only where not read as they are
    assert torch.equal(logits["0"], logits["1"])


def test_a_batch_of_two_padded_rows_gives_the_same_logits_with_shared_heads_read_or_copied(monkeypatch):
    """At B > 1 every forward carries a mask. A forward of several tokens gives the same logits bit for bit; a one-token
    forward, which transformers otherwise computes with the query heads packed per shared head, within float32
    rounding (measured: 3e-6 on logits of this model)."""
    model = tiny_model("qwen2", layers=2)
    logits = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(SDPA_GQA, setting)
        cache = BatchCache(model, 2)
        tokens, fed = padded_rows([list(range(3, 30)), list(range(5, 17))], left=True)
        prefill = cache.forward(tokens, fed)[0]
        chain = cache.forward(torch.tensor([[7, 8, 9], [4, 5, 6]]))[0]
        one = cache.forward(torch.tensor([[11], [12]]))[0]
        logits[setting] = (prefill, chain, one)
    (prefill, chain, one), (prefill_read, chain_read, one_read) = logits["0"], logits["1"]
    assert torch.equal(prefill, prefill_read) and torch.equal(chain, chain_read)
    torch.testing.assert_close(one, one_read, rtol=0, atol=1e-5)
