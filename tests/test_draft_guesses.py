"""drafter.guesses: prompt-lookup guesses ride along with the model drafter's forwards. Every guess the
drafter's own choice confirms is a draft from the same forward, so the drafts (and so the outputs) are
the ones drafted without guesses, in fewer drafter forwards."""

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


def test_a_run_at_batch_size_4_says_it_drafts_without_guesses_and_its_label_says_so():
    from conftest import run_config

    from mars_bench.config.checks import check_run_config
    from mars_bench.config.method import method_spec

    single = run_config()  # the embedded pair's tuning sets guesses=3 and context_vocab
    assert single.drafter.guesses == 3 and single.drafter.context_vocab
    assert "guesses=3" in method_spec(single).drafter_setting and "context_vocab=True" in method_spec(single).drafter_setting
    with pytest.raises(ValueError, match=r"^drafter.guesses=3 \(set by tuning=cpu"):
        check_run_config(run_config("batch_size=4"))  # refused in one line, not dropped
    batched = run_config("batch_size=4", "drafter.guesses=0", "drafter.context_vocab=false")
    check_run_config(batched)
    assert method_spec(batched).drafter_settings.guesses == 0 and "guesses" not in method_spec(batched).drafter_setting
    assert not method_spec(batched).drafter_settings.context_vocab and "context_vocab" not in method_spec(batched).drafter_setting


def test_the_batched_engine_refuses_a_drafter_with_guesses_in_one_line():
    from conftest import tiny_model

    from mars_bench.drafting.batched import batch_drafter

    drafter = ModelDrafter(tiny_model(), settings=ModelSettings(guesses=2))
    with pytest.raises(
        ValueError, match=r"^drafter.guesses=2 rides on one sequence's drafter forwards: allowed at batch_size > 1 is 0$"
    ):
        batch_drafter(drafter)
    prompted = ModelDrafter(tiny_model(), settings=ModelSettings(draft_vocab=8, context_vocab=True))
    with pytest.raises(ValueError, match=r"^drafter.context_vocab=true scores one sequence's own tokens: allowed at batch_"):
        batch_drafter(prompted)
