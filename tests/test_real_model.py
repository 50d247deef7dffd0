"""On a real model (SmolLM2-135M-Instruct from its pinned mirror, fp32): the layer-skip and
lookup drafters with ``exact`` reproduce the baseline, which equals ``model.generate``."""

from __future__ import annotations

import pytest
import torch

from mars_bench import build_drafter, decode
from mars_bench.models.loading import chat_prompt_ids, stop_token_ids

pytestmark = pytest.mark.slow  # SmolLM2-135M from its mirror

QUESTION = "Write a Python function that returns the n-th Fibonacci number."
# 24 tokens: the layer-skip drafter keeps 9 of its 47 drafts and lookup 1 of its 17 (its first n-gram match that
# the target keeps comes at token 20), so both drafters' kept and rejected drafts are checked against the baseline.
NEW_TOKENS = 24


def test_exact_with_layerskip_and_lookup_equals_the_baseline(smollm):
    prompt = chat_prompt_ids(smollm.tokenizer, [QUESTION])
    stops = stop_token_ids(smollm)
    baseline = decode(smollm.model, None, None, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
    reference = smollm.model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=stops, pad_token_id=stops[0]
    )
    assert baseline.tokens == reference[0, len(prompt) :].tolist()
    for drafter in (build_drafter("layerskip", target=smollm.model, layers=24), build_drafter("lookup")):
        result = decode(smollm.model, drafter, "exact", prompt, max_new_tokens=NEW_TOKENS, gamma=4, stop_token_ids=stops)
        assert result.tokens == baseline.tokens
        assert result.accepted > 0


def test_the_mirror_is_recorded_with_its_hash(smollm):
    assert smollm.resolved.source in {"mirror", "cache"}
    assert smollm.resolved.details["gguf_sha256"].startswith("b179c952")
