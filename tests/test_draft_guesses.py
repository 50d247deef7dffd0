"""drafter.guesses: prompt-lookup guesses ride along with the model drafter's forwards. Every guess the
drafter's own choice confirms is a draft from the same forward, so the drafts (and so the outputs) are
the ones drafted without guesses, in fewer drafter forwards; in a batch, each row's guesses are its own
and its drafts are those it drafts alone."""

from __future__ import annotations

import pytest
import torch

from mars_bench.decoding.draft_length import FixedLength
from mars_bench.decoding.engine import decode
from mars_bench.drafting.layerskip import truncated_model
from mars_bench.drafting.lookup import lookup_continuation
from mars_bench.drafting.model import ModelDrafter, ModelSettings
from mars_bench.drafting.stop import ConfidenceStop, GainStop
from mars_bench.models.loading import stop_token_ids
from mars_bench.perf.suite import first_turn_prompts

NEW_TOKENS = 16


def counted_drafts(smollm, guesses: int, temperature: float) -> tuple[list, list, int]:
    """(outputs, each step's (drafted, accepted), drafter forwards) on a HumanEval prompt, drafted by
    SmolLM2's first 20 of 30 layers with a stop rule (so drafts are kept, rejected and cut short): greedy a
    confidence stop, sampling a gain stop (which learns from the verdicts, so its stops depend on them too)."""
    stop = ConfidenceStop(0.4) if temperature == 0 else GainStop(0.15)
    drafter = ModelDrafter(truncated_model(smollm.model, 20), smollm.model.config.vocab_size, stop=stop,
                           settings=ModelSettings(guesses=guesses))  # fmt: skip
    prompts = first_turn_prompts(smollm.tokenizer, "humaneval", 1)
    forwards = []
    hook = drafter.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        results = [decode(smollm.model, drafter, "exact" if temperature == 0 else "rejection", prompt, max_new_tokens=NEW_TOKENS,
                          temperature=temperature, seed=3, stop_token_ids=stop_token_ids(smollm), draft_length=FixedLength(8))
                   for prompt in prompts]  # fmt: skip
    finally:
        hook.remove()
    return [r.tokens for r in results], [[(s.drafted, s.accepted) for s in r.steps] for r in results], len(forwards)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guesses_leave_every_draft_and_output_as_without_them_in_fewer_drafter_forwards(smollm, temperature):
    outputs, steps, forwards = counted_drafts(smollm, 0, temperature)
    guessed_outputs, guessed_steps, guessed_forwards = counted_drafts(smollm, 3, temperature)
    assert guessed_outputs == outputs  # the same seed draws the same uniforms: sampled drafts are the same too
    assert guessed_steps == steps
    assert any(accepted < drafted for row in steps for drafted, accepted in row)  # rejections were exercised
    assert guessed_forwards < forwards


def test_lookup_continuation_copies_what_followed_the_longest_earlier_match():
    sequence = torch.tensor([5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7])
    assert lookup_continuation(sequence, 3, 2, 3).tolist() == [9, 4, 6]  # the most recent "6 7" is followed by 9
    assert lookup_continuation(torch.tensor([1, 2, 3, 2, 4]), 2, 2, 3).tolist() == []  # no earlier "2 4"
    assert lookup_continuation(torch.tensor([1, 2, 3, 1, 2]), 5, 2, 3).tolist() == [3, 1, 2]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_guesses_value_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"drafter.guesses=.* is invalid: allowed is an integer >= 0"):
        ModelSettings(guesses=value)


def successor_model(jump: int, seed: int):
    """A 2-layer Llama over 96 tokens whose greedy next token is the newest one + 1 (+ 1 + ``jump`` after a multiple
    of 7), its random layers scaled down so that the context moves its probabilities only: on ascending prompts,
    prompt lookup guesses what it drafts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    tokens = torch.arange(96)
    model.model.embed_tokens.weight.zero_()[tokens, tokens] = 1.0
    model.lm_head.weight.zero_()[(tokens + 1 + jump * (tokens % 7 == 0)) % 96, tokens] = 1.0
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(0.002)
        layer.mlp.down_proj.weight.mul_(0.002)
    return model


# Ascending prompts, one with a run broken off: at (14, 18) lookup guesses 70, which the drafter's 19 refutes.
ASCENDING = [[*range(90), 10, 11], [*range(5, 70), 30], [*range(40), 14, 18, 70, 71, 72, 8, 9], [3, 4, *range(80)]]


def batch_drafts(guesses: int, temperature: float, batched: bool) -> tuple[list, list, int]:
    """``counted_drafts`` on ``ASCENDING``, decoded one by one or as one batch of four: a target that mostly goes up
    by one, drafted by a model that always does, under a stop rule (greedy a confidence stop, sampling a gain stop)."""
    from mars_bench.decoding.batched import decode_batch

    target = successor_model(jump=3, seed=0)
    stop = ConfidenceStop(0.5) if temperature == 0 else GainStop(0.02)
    drafter = ModelDrafter(successor_model(jump=0, seed=1), 96, stop=stop, settings=ModelSettings(guesses=guesses))
    settings = {"max_new_tokens": 24, "temperature": temperature, "draft_length": FixedLength(6)}
    verifier = "exact" if temperature == 0 else "rejection"
    forwards = []
    hook = drafter.model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        if batched:
            results = decode_batch(target, drafter, verifier, ASCENDING, seeds=range(len(ASCENDING)), **settings)
        else:
            results = [decode(target, drafter, verifier, prompt, seed=seed, **settings) for seed, prompt in enumerate(ASCENDING)]
    finally:
        hook.remove()
    return [r.tokens for r in results], [[(s.drafted, s.accepted) for s in r.steps] for r in results], len(forwards)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_guesses_draft_each_row_of_a_batch_as_alone_and_as_without_guesses_in_fewer_forwards(temperature):
    outputs, steps, _ = batch_drafts(3, temperature, batched=False)
    batched_outputs, batched_steps, forwards = batch_drafts(3, temperature, batched=True)
    unguessed_outputs, unguessed_steps, unguessed_forwards = batch_drafts(0, temperature, batched=True)
    assert batched_outputs == outputs == unguessed_outputs  # each row draws its own uniforms, one per draft, as alone
    assert batched_steps == steps == unguessed_steps
    assert any(0 < accepted < drafted for row in steps for drafted, accepted in row)  # drafts kept and rejected
    assert forwards < unguessed_forwards


def test_the_tuned_default_keeps_its_guesses_and_context_tokens_at_batch_size_4():
    from conftest import run_config

    from mars_bench.config.checks import check_run_config
    from mars_bench.config.method import method_spec

    batched = run_config("batch_size=4")  # the embedded pair's tuning sets guesses=3 and context_vocab
    check_run_config(batched)
    assert batched.drafter.guesses == 3 and batched.drafter.context_vocab
    assert "guesses=3" in method_spec(batched).drafter_setting and "context_vocab=True" in method_spec(batched).drafter_setting
