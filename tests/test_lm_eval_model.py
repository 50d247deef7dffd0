"""The lm-eval model: the draft length is set as in the app (fixed, schedule, confidence), checked
before any model loads, and speculative decoding under it stays the target's greedy decode.
(The docs' lm-eval command runs in test_readme.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mars_bench.backends import Requests, hf
from mars_bench.drafting.stop import ConfidenceStop, GainStop
from mars_bench.lm_eval_model import MarsBenchLM, request_sampling
from mars_bench.tasks.questions import Question
from mars_bench.verification.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
# 12 tokens: 8 steps of SmolLM2's layer-skip drafts, in which each draft length drafts its own lengths (the schedule
# shrinks on rejections and grows on a full acceptance, the confidence cut stops drafts early) and drafts are kept and rejected.
GREEDY = {"max_gen_toks": 12, "until": []}
STORY_TOKENS = 16  # the story the stop-string test cuts: enough text for a stop string first seen halfway
SAMPLED_TOKENS = 8  # the sea poem on the tiny target: its greedy and sampled answers differ from the first token on


@pytest.mark.parametrize(("setting", "message"), [
    ({"length": "adaptive"}, "drafter.length='adaptive' is invalid: allowed are fixed, schedule, confidence, gain"),
    ({"length": "gain", "draft_cost": 0}, "drafter.draft_cost=0 is invalid: allowed is a number > 0"),
    ({"length": "schedule", "max_gamma": 3}, "drafter.max_gamma=3 is invalid: allowed is an integer >= gamma (5)"),
    ({"length": "confidence", "min_confidence": 1.5}, "drafter.min_confidence=1.5 is invalid: allowed is a number in (0, 1)"),
])  # fmt: skip
def test_a_bad_draft_length_is_refused_in_one_line_before_any_model_loads(setting, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        MarsBenchLM(target="no/such-model", drafter="layerskip", verifier="exact", **setting)


def test_a_tree_drafts_no_deeper_than_its_node_budget_under_a_schedule():
    with pytest.raises(ValueError, match=r"drafter.max_gamma=7 is invalid: allowed is an integer >= gamma \(8\)"):
        MarsBenchLM(target="no/such-model", drafter="model_tree", verifier="exact", gamma=8, length="schedule", tree_tokens=8)


@pytest.fixture(scope="module")
def session_smollm(smollm):
    """Every MarsBenchLM here on SmolLM2 gets the session's SmolLM2 in fp32 (``conftest.smollm``) from its backend's
    loader, one load for the module (the docs' lm-eval command, in test_readme, loads it through the loader itself);
    another model (the tiny target) loads as it would."""
    real = hf.load_model

    def load(name: str, dtype: str = "bfloat16", **options):
        if name != SMOLLM:
            return real(name, dtype=dtype, **options)
        assert dtype == "float32", (name, dtype)
        return smollm

    hf.forget_loaded_models()  # the backend's loads are cached per process: the next ones load through ``load``
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf, "load_model", load)
        yield
    hf.forget_loaded_models()


@pytest.mark.slow
def test_each_draft_length_keeps_the_targets_greedy_decode(session_smollm):
    plain = MarsBenchLM(target=SMOLLM, drafter="none", verifier="exact", dtype="float32")
    context = plain.apply_chat_template([{"role": "user", "content": "Count from one to twenty in words."}])
    expected = plain.generate(context, GREEDY)
    for length, stop in (("confidence", ConfidenceStop(0.4)), ("gain", GainStop(0.15)), ("schedule", None), ("fixed", None)):
        lm = MarsBenchLM(target=SMOLLM, drafter="layerskip", verifier="exact", dtype="float32", layers=24, length=length)
        assert lm.spec.draft_stop() == stop  # what the backend builds the drafter with
        assert (lm.spec.length.length, lm.spec.length.gamma, lm.spec.max_draft_depth) == (length, 5, 16)
        assert lm.generate(context, GREEDY) == expected, length


@pytest.mark.parametrize(("gen_kwargs", "default", "expected"), [
    ({}, SamplingParams(0.7, 0.9), SamplingParams(0.7, 0.9)),  # the task sets nothing: model_args' sampling
    ({"do_sample": False, "temperature": 0.8}, SamplingParams(1.0), SamplingParams(0.0)),  # do_sample false is greedy
    ({"do_sample": True, "temperature": 1.0}, SamplingParams(0.0), SamplingParams(1.0)),
    ({"do_sample": True}, SamplingParams(0.0), SamplingParams(1.0)),  # transformers' default temperature
    ({"do_sample": True}, SamplingParams(0.6), SamplingParams(0.6)),
    ({"temperature": 0.5, "top_p": 0.9, "top_k": 40}, SamplingParams(0.0), SamplingParams(0.5, 0.9, 40)),
    ({"temperature": 0.0}, SamplingParams(1.0, 0.8), SamplingParams(0.0, 0.8)),
])  # fmt: skip
def test_a_tasks_sampling_settings_win_over_the_model_args(gen_kwargs, default, expected):
    assert request_sampling(gen_kwargs, default) == expected


@pytest.fixture(scope="module")
def layerskip_lm(session_smollm):
    return MarsBenchLM(target=SMOLLM, drafter="layerskip", verifier="exact", dtype="float32", layers=24)


@pytest.fixture(scope="module")
def tiny_lm(session_smollm, tiny_target):
    """The lm-eval model on the tiny target (conftest.tiny_target: SmolLM2's tokenizer and chat template, a random
    model), drafting with its first 2 of 4 layers: for what the harness does with a request's stop strings and
    sampling, which holds for any model."""
    return MarsBenchLM(target=str(tiny_target), drafter="layerskip", verifier="exact", dtype="float32", layers=2)


def recorded_decodes(lm: MarsBenchLM, monkeypatch) -> list:
    """Every request ``lm`` decodes from now on: (the method its backend ran, the request's result)."""
    calls = []
    generate = lm.backend.generate

    def recorded(method, requests):
        results = generate(method, requests)
        calls.extend((method, result) for result in results)
        return results

    monkeypatch.setattr(lm.backend, "generate", recorded)
    return calls


@pytest.mark.slow
def test_a_stop_string_ends_decoding_where_it_appears_and_the_answer_is_todays(layerskip_lm, monkeypatch):
    lm = layerskip_lm
    decodes = recorded_decodes(lm, monkeypatch)  # SmolLM2: the tiny target's greedy text repeats one token
    context = lm.apply_chat_template([{"role": "user", "content": "Write a short story about a robot who learns to paint."}])
    prompt = lm.tokenizer(context, add_special_tokens=False)["input_ids"]
    full, = lm.backend.generate(lm.method(lm.spec), Requests([prompt], [lm.seed], STORY_TOKENS, lm.stops))
    text = lm.tokenizer.decode(full.tokens, skip_special_tokens=True)
    middle = len(text) // 2
    stop = next(text[at : at + 6] for at in range(middle, len(text) - 6) if text[at : at + 6] not in text[: at + 5])
    todays = text[: text.find(stop)]  # what the model answered before: the whole budget decoded, then cut
    assert len(todays) >= middle  # the stop string first appears halfway through

    answer = lm.generate(context, {"until": [stop], "max_gen_toks": STORY_TOKENS})
    _, (_, result) = decodes  # the whole budget above, then the request
    assert answer == todays
    assert result.stop_reason == "stop_string" and result.tokens == full.tokens[: len(result.tokens)]
    decoded = [lm.tokenizer.decode(full.tokens[:n], skip_special_tokens=True) for n in range(len(full.tokens) + 1)]
    first = next(n for n, part in enumerate(decoded) if stop in part)  # the stop string is complete after `first` tokens
    assert first <= len(result.tokens) <= first + lm.spec.length.gamma + 1  # at most one step's drafts past it
    assert len(result.tokens) < len(full.tokens)


@pytest.mark.slow
def test_a_task_asking_for_sampling_is_sampled(tiny_lm, monkeypatch):
    lm = tiny_lm
    decodes = recorded_decodes(lm, monkeypatch)
    context = lm.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    greedy = lm.generate(context, {"until": [], "max_gen_toks": SAMPLED_TOKENS})
    sampled = lm.generate(context, {"until": [], "max_gen_toks": SAMPLED_TOKENS, "do_sample": True, "temperature": 1.0})
    assert [method.spec.sampling.temperature for method, _ in decodes] == [0.0, 1.0]
    assert sampled != greedy


EXAMPLE = REPO / "examples" / "lm_eval"


def test_the_lm_eval_examples_questions_are_the_apps_gsm8k_questions(monkeypatch):
    sys.path.insert(0, str(EXAMPLE))
    try:
        from gsm8k_questions import gsm8k_test
    finally:
        sys.path.remove(str(EXAMPLE))
    from mars_bench.tasks import providers
    from mars_bench.tasks.options import task_option

    monkeypatch.setattr(providers, "load_questions", lambda task, data_dir=None: [
        Question(1, ["What is 2 + 3?"], reference=["2 + 3 = 5\n#### 5"])] if task.name == "gsm8k" else [])  # fmt: skip
    split = gsm8k_test()["test"]
    assert split[0]["turns"] == ["What is 2 + 3?"] and split[0]["reference"][-1].endswith("#### 5")
    assert task_option("gsm8k", num_prompts=None).num_prompts is None
    with pytest.raises(ValueError, match="^task 'gsm8' is unknown: allowed are aime2025, alpaca, "):
        task_option("gsm8")


def test_the_decode_tally_pools_tau_and_acceptance_over_requests():
    from mars_bench.decoding.trace import DecodeResult, StepRecord
    from mars_bench.lm_eval_model import DecodeTally

    tally = DecodeTally()
    tally.add(DecodeResult(3, [1, 2, 3, 4], [StepRecord(4, 2, 0, 9, 3)], 0.5, 0.5, "stop_token"))  # 1 step emits 3
    tally.add(DecodeResult(3, [1, 2, 3], [StepRecord(4, 0, 0, 9, 1), StepRecord(2, 1, 0, 9, 1)], 1.0, 1.0, "stop_token"))
    assert (tally.requests, tally.new_tokens, tally.steps, tally.emitted) == (2, 7, 3, 5)
    assert tally.tau == 5 / 3 and tally.acceptance == 3 / 10 and tally.tokens_per_s == 7 / 3
    assert tally.line() == ("mars_bench: 2 requests, 7 new tokens in 3.0 s (2.33 tok/s), tau 1.67, acceptance 0.300 "
                            "(3 of 10 drafts kept)")  # fmt: skip


@pytest.mark.parametrize(("batch_size", "message"), [
    ("auto", "batch_size='auto' is invalid: allowed is an integer >= 1"),
    (0, "batch_size='0' is invalid: allowed is an integer >= 1"),
])  # fmt: skip
def test_a_bad_batch_size_is_refused_in_one_line_before_any_model_loads(batch_size, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        MarsBenchLM(target="/nonexistent", drafter="lookup", batch_size=batch_size)


@pytest.mark.slow
def test_lm_evals_batch_size_decodes_requests_together_with_todays_answers(layerskip_lm, monkeypatch):
    from types import SimpleNamespace

    calls = []

    def recorded(method, requests):
        calls.append(len(requests.prompts))
        return generate(method, requests)

    generate = layerskip_lm.backend.generate
    monkeypatch.setattr(layerskip_lm.backend, "generate", recorded)
    topics = ["the sea", "a robot", "the moon"]
    asked = [[{"role": "user", "content": f"Write a poem about {topic}."}] for topic in topics]
    contexts = [layerskip_lm.apply_chat_template(messages) for messages in asked]
    requests = [SimpleNamespace(args=(context, {"until": ["\n\n"], "max_gen_toks": 8})) for context in contexts]
    alone = layerskip_lm.generate_until(requests, disable_tqdm=True)
    assert calls == [1, 1, 1]  # each alone: a batch of one
    monkeypatch.setattr(layerskip_lm, "batch_size", 2)
    together = layerskip_lm.generate_until(requests, disable_tqdm=True)
    assert calls == [1, 1, 1, 2, 1]  # the first two together; the third alone
    assert together == alone and all(alone)
