"""The engine: ``exact`` with any drafter reproduces the autoregressive baseline token for
token in fp32; stop tokens, budgets and counters behave identically for every method."""

from __future__ import annotations

import time
from copy import deepcopy

import pytest
import torch
from conftest import tiny_model

from mars_bench import build_drafter, decode, get_verifier
from mars_bench.decoding.draft_length import AcceptanceSchedule, draft_length_policy
from mars_bench.drafting import (
    available_drafters,
    drafter_needs_model,
    drafter_settings,
    drafters_without_model,
    is_tree_drafter,
)
from mars_bench.drafting.stop import ConfidenceStop, GainStop

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors

PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3], [11]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def target(request):
    return tiny_model(request.param, seed=0)


@pytest.fixture(scope="module")
def every_drafter(target):
    """One of each drafter kind for ``target``, reused across prompts and draft lengths as the app reuses its drafter."""
    other = tiny_model("llama", seed=7, layers=2)
    return {
        "other-model": build_drafter("model", model=other, vocab_size=target.config.vocab_size),
        "self": build_drafter("model", model=target),
        "layerskip": build_drafter("layerskip", target=target, layers=2),
        "lookup": build_drafter("lookup"),
    }


# 24 tokens: for each target and draft length, each drafter keeps drafts and rejects drafts where it does in 40 (layer-skip
# and lookup both; the unrelated random model rejects all but at most one; the target drafting for itself keeps every one).
EVERY_DRAFTER_TOKENS = 24


@pytest.fixture(scope="module")
def baselines(target):
    """The autoregressive decode of each of PROMPTS (``EVERY_DRAFTER_TOKENS`` new tokens), once for every draft length."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the speculative decodes run (one_torch_thread): the same kernels, the same sums
    try:
        return [decode(target, None, None, prompt, max_new_tokens=EVERY_DRAFTER_TOKENS) for prompt in PROMPTS]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.slow
def test_exact_reproduces_the_baseline_with_every_drafter(target, every_drafter, baselines, gamma):
    for prompt, baseline in zip(PROMPTS, baselines):
        for label, drafter in every_drafter.items():
            result = decode(target, drafter, "exact", prompt, max_new_tokens=EVERY_DRAFTER_TOKENS, gamma=gamma)
            assert result.tokens == baseline.tokens, f"{label} gamma={gamma} prompt={prompt}"


def test_self_drafting_accepts_every_draft(target):
    result = decode(target, build_drafter("model", model=target), "exact", PROMPTS[0], max_new_tokens=31, gamma=5)
    assert [step.accepted for step in result.steps] == [5] * 5
    assert result.tau == 6.0  # 30 tokens after the prefill token, 5 verification forwards
    assert result.drafted == 25 and result.accepted == 25


def test_the_baseline_is_one_token_per_forward(target):
    result = decode(target, None, None, PROMPTS[1], max_new_tokens=12)
    assert result.new_tokens == 12 and result.verify_steps == 11 and result.tau == 1.0


def test_the_baseline_equals_transformers_generate(target):
    prompt = torch.tensor([PROMPTS[1]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert decode(target, None, None, PROMPTS[1], max_new_tokens=20).tokens == reference[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_the_budget_caps_every_method_identically(target, max_new_tokens):
    self_drafter = build_drafter("model", model=target)
    baseline = decode(target, None, None, PROMPTS[0], max_new_tokens=max_new_tokens)
    speculative = decode(target, self_drafter, "exact", PROMPTS[0], max_new_tokens=max_new_tokens, gamma=5)
    assert baseline.new_tokens == speculative.new_tokens == max_new_tokens
    assert speculative.tokens == baseline.tokens
    assert speculative.stop_reason == "max_new_tokens"


def test_tokens_past_a_stop_token_in_an_accepted_block_are_discarded(target):
    baseline = decode(target, None, None, PROMPTS[0], max_new_tokens=30)
    stop = baseline.tokens[9]  # a token the model emits mid-sequence
    first = baseline.tokens.index(stop)
    expected = baseline.tokens[: first + 1]
    for drafter in (None, build_drafter("model", model=target)):
        result = decode(target, drafter, "exact", PROMPTS[0], max_new_tokens=30, gamma=6, stop_token_ids=[stop])
        assert result.tokens == expected and result.stop_reason == "stop_token"


def test_same_seed_gives_the_same_sample(target):
    drafter = build_drafter("model", model=tiny_model("llama", seed=7, layers=2), vocab_size=96)
    runs = [decode(target, drafter, "rejection", PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=5).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    other = decode(target, drafter, "rejection", PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=6).tokens
    assert other != runs[0]


@pytest.mark.slow
def test_mars_with_relaxation_off_decodes_like_the_strict_rules(target):
    drafter = build_drafter("model", model=tiny_model("llama", seed=7, layers=2), vocab_size=96)
    for temperature, strict in ((0.0, "exact"), (1.0, "rejection")):
        kwargs = dict(max_new_tokens=30, temperature=temperature, seed=3, gamma=4)
        off = decode(target, drafter, get_verifier("mars", theta=None), PROMPTS[1], **kwargs)
        reference = decode(target, drafter, strict, PROMPTS[1], **kwargs)
        assert off.tokens == reference.tokens
        assert [s.accepted for s in off.steps] == [s.accepted for s in reference.steps]


def perturbed_copy(model, scale: float):
    """The same model with a noisy head: its argmax flips to the runner-up at near-ties."""
    copy = deepcopy(model)
    torch.manual_seed(1)
    copy.lm_head.weight.add_(scale * torch.randn_like(copy.lm_head.weight))
    return copy


def test_mars_relaxes_on_a_real_margin_and_counts_it(target):
    drafter = build_drafter("model", model=perturbed_copy(target, scale=0.1))
    strict = decode(target, drafter, "exact", PROMPTS[0], max_new_tokens=60, gamma=4)
    relaxed = decode(target, drafter, get_verifier("mars", theta=0.5, guard="gap"), PROMPTS[0], max_new_tokens=60, gamma=4)
    assert relaxed.relaxed > 0
    assert relaxed.relaxed == sum(step.reasons.count(1) for step in relaxed.steps)
    assert relaxed.accepted / relaxed.drafted > strict.accepted / strict.drafted


@pytest.mark.slow
def test_shadow_verifiers_judge_the_same_drafts_without_changing_the_output(target):
    drafter = build_drafter("model", model=perturbed_copy(target, scale=0.1))
    relaxed = get_verifier("mars", theta=0.5, guard="gap")
    for temperature in (0.0, 1.0):
        kwargs = dict(max_new_tokens=60, gamma=4, temperature=temperature, seed=2)
        alone = decode(target, drafter, "rejection", PROMPTS[0], **kwargs)
        watched = decode(target, drafter, "rejection", PROMPTS[0], shadow=["rejection", relaxed, "exact"], **kwargs)
        assert watched.tokens == alone.tokens
        assert [s.accepted for s in watched.steps] == [s.accepted for s in alone.steps]
        twin, mars, exact = watched.shadow_accepted(3)
        assert len(mars) == len(watched.steps)
        if temperature == 0.0:  # deterministic rules: the twin agrees step for step, mars keeps at least as many
            assert twin == [s.accepted for s in watched.steps] == exact
            assert all(m >= a for m, a in zip(mars, exact)) and sum(mars) > sum(exact)
        assert all(0 <= kept <= s.drafted for kept, s in zip(mars, watched.steps))


def test_adaptive_draft_lengths_stay_lossless_and_vary_the_drafts(target):
    reference = decode(target, None, None, PROMPTS[1], max_new_tokens=40)
    close = perturbed_copy(target, scale=0.1)
    confident = build_drafter("model", model=close, stop=ConfidenceStop(0.1))
    gaining = build_drafter("model", model=close, stop=GainStop(0.3))
    scheduled = (build_drafter("model", model=close), AcceptanceSchedule(3, maximum=6))
    for drafter, policy in (scheduled, (confident, None), (gaining, None)):
        result = decode(target, drafter, "exact", PROMPTS[1], max_new_tokens=40, gamma=6, draft_length=policy)
        assert result.tokens == reference.tokens
        assert len({step.drafted for step in result.steps[:-1]}) > 1  # the length changed from step to step


def test_the_acceptance_schedule_grows_on_full_acceptance_and_shrinks_on_a_reject():
    schedule = AcceptanceSchedule(3, minimum=1, maximum=4)
    lengths = []
    for drafted, accepted in ((3, 3), (4, 4), (4, 4), (4, 1), (3, 0), (2, 0), (1, 0), (0, 0)):
        schedule.observe(drafted, accepted)
        lengths.append(schedule.next())
    assert lengths == [4, 4, 4, 3, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="drafter.length='wild' is invalid: allowed are fixed, schedule, confidence, gain"):
        draft_length_policy("wild", 5)
    with pytest.raises(ValueError, match="min_confidence=1.5 is invalid"):
        build_drafter("model", model=target_stub(), stop=ConfidenceStop(1.5))


def target_stub():
    return tiny_model("llama", seed=7, layers=1)


def test_step_records_carry_counters_and_phase_times(target):
    drafter = build_drafter("model", model=tiny_model("llama", seed=7, layers=2), vocab_size=96)
    start = time.perf_counter()
    result = decode(target, drafter, "mars", PROMPTS[0], max_new_tokens=20, gamma=3)
    wall = time.perf_counter() - start
    assert sum(step.emitted for step in result.steps) == result.new_tokens - 1
    for step in result.steps:
        assert len(step.reasons) == min(step.accepted + 1, step.drafted)
        assert len(step.values["margin"]) == len(step.flags["trigger"]) == len(step.reasons)  # mars's statistics
        assert step.draft_s >= 0 and step.target_s > 0 and step.verify_s > 0
    accepted, reached = result.accepted_per_depth()
    assert reached[0] == sum(step.drafted > 0 for step in result.steps)
    assert all(a <= r for a, r in zip(accepted, reached))
    assert 0 < result.prefill_s + result.decode_s <= wall


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0 is invalid: allowed is an integer >= 1"),
        ({"gamma": 0}, "gamma=0 is invalid"),
        ({"temperature": -1.0}, "temperature=-1.0 is invalid"),
        ({"top_p": 0.0}, "top_p=0.0 is invalid"),
    ],
)
def test_bad_decode_settings_fail_before_any_forward(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode(target, None, None, PROMPTS[0], **kwargs)


def test_unknown_drafter_names_are_refused():
    allowed = "eagle3, layerskip, lookup, model, model_tree, none"
    with pytest.raises(ValueError, match=f"unknown drafter 'medusa': allowed are {allowed}"):
        build_drafter("medusa")


def test_a_setting_the_drafter_does_not_declare_is_refused_in_one_line():
    allowed = "top_k, tree_tokens, draft_vocab, token_counts, context_vocab, weights"
    with pytest.raises(ValueError, match=f"^drafter model_tree has no setting 'topk': allowed are {allowed}$"):
        build_drafter("model_tree", model=target_stub(), topk=3)
    model_keys = "draft_vocab, token_counts, context_vocab, weights, guesses"
    with pytest.raises(ValueError, match=f"^drafter model has no setting 'layers': allowed are {model_keys}$"):
        build_drafter("model", model=target_stub(), layers=2)
    with pytest.raises(ValueError, match=r"^drafter none has no setting 'top_k': allowed are none$"):
        build_drafter("none", top_k=3)
    assert build_drafter("none") is None


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        ("model_tree", {"top_k": 0}, r"drafter.top_k=0 is invalid: allowed is an integer >= 1"),
        ("eagle3", {"tree_tokens": 1}, r"drafter.tree_tokens=1 is invalid: allowed is an integer >= 2"),
        ("layerskip", {"layers": 0}, r"drafter.layers=0 is invalid: allowed is an integer >= 1 or null"),
        ("lookup", {"min_ngram": 3, "max_ngram": 2}, r"drafter.min_ngram=3, drafter.max_ngram=2 are invalid"),
    ],
)
def test_settings_out_of_range_are_refused_before_any_model_is_needed(name, settings, message):
    with pytest.raises(ValueError, match=message) as error:
        drafter_settings(name)(**settings)
    assert "\n" not in str(error.value)


def test_the_registry_says_which_drafters_need_a_model_and_draft_trees():
    with_model = {name for name in available_drafters() if drafter_needs_model(name)}
    trees = {name for name in available_drafters() if is_tree_drafter(name)}
    assert with_model == {"model", "model_tree"}
    assert trees == {"model_tree", "eagle3"}
    assert drafters_without_model() == "eagle3, layerskip, lookup, none"


def test_describe_is_the_name_and_the_settings_in_use(target, tmp_path):
    assert build_drafter("model", model=target).describe() == {"name": "model"}
    (tmp_path / "counts.json").write_text("[5, 4, 3, 2, 1, 1, 1, 1, 1]")
    reduced = build_drafter("model", model=target, draft_vocab=8, token_counts=str(tmp_path / "counts.json"))
    assert reduced.describe() == {"name": "model", "draft_vocab": 8, "token_counts": str(tmp_path / "counts.json")}
    assert build_drafter("model_tree", model=target, top_k=2).describe() == {"name": "model_tree", "top_k": 2, "tree_tokens": 16}
    assert build_drafter("lookup", max_ngram=2).describe() == {"name": "lookup", "min_ngram": 1, "max_ngram": 2}
    # layerskip's default depth (a quarter of the target's 4 layers) is recorded as resolved.
    assert build_drafter("layerskip", target=target).describe() == {"name": "layerskip", "layers": 1}


def test_layerskip_depth_is_checked(target):
    with pytest.raises(ValueError, match=r"layers=4 is invalid: allowed is an integer in \[1, 3\]"):
        build_drafter("layerskip", target=target, layers=4)


def test_lookup_proposes_what_followed_the_last_ngram():
    from mars_bench.verification.sampling import SamplingParams

    drafter = build_drafter("lookup", max_ngram=2)
    context = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6])
    draft = drafter.propose_sequence(context, 3, SamplingParams(), None)
    assert draft.tokens.tolist() == [7, 8, 9] and draft.dists is None
    assert len(drafter.propose_sequence(torch.tensor([1, 2, 3]), 3, SamplingParams(), None)) == 0
