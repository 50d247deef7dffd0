"""A reduced draft vocabulary (``drafter.draft_vocab``): the model drafters score only the K most
frequent target tokens, ranked by a hash-named cached count over ShareGPT (never evaluation
answers) or by the user's own count file; their q is zero off the subset, and verification
is unchanged, so ``exact`` reproduces the target's greedy decode token for token. That
``rejection`` stays lossless with q on a subset is the distribution test in
``test_distribution.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import SMOKE, app, is_quantized, tiny_model

from mars_bench import build_drafter, decode
from mars_bench.drafting.draft_vocab import (
    DraftVocabSettings,
    ReducedHeadModel,
    conversation_texts,
    frequent_token_ids,
    load_token_counts,
    sharegpt_token_counts,
)
from mars_bench.drafting.draft_weights import quantized_draft_model
from mars_bench.models.kvcache import cached_forward
from mars_bench.verification.sampling import SamplingParams

SMOLLM = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3]]


def test_the_k_most_counted_ids_are_kept_ties_to_the_lower_id_with_the_special_tokens():
    counts = np.array([5, 9, 9, 0, 1, 7])
    assert frequent_token_ids(counts, 3).tolist() == [1, 2, 5]
    assert frequent_token_ids(counts, 3, always=[3, 1]).tolist() == [1, 2, 3, 5]
    with pytest.raises(ValueError, match=r"^drafter.draft_vocab=7 is invalid: allowed is an integer in \[1, 6\] or null$"):
        frequent_token_ids(counts, 7)


@pytest.mark.parametrize(("settings", "message"), [
    ({"draft_vocab": 0}, "drafter.draft_vocab=0 is invalid: allowed is an integer >= 1 or null"),
    ({"draft_vocab": "many"}, "drafter.draft_vocab='many' is invalid"),
    ({"token_counts": "counts.npy"}, "drafter.token_counts='counts.npy' ranks tokens for drafter.draft_vocab, which is null"),
    ({"context_vocab": True}, "drafter.context_vocab=true adds the context's tokens to drafter.draft_vocab, which is null"),
    ({"draft_vocab": 8, "context_vocab": "yes"}, "drafter.context_vocab='yes' is invalid: allowed are true and false$"),
])  # fmt: skip
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        DraftVocabSettings(**settings)


def test_a_users_count_file_is_read_as_npy_or_json_and_padded_to_the_vocabulary(tmp_path):
    np.save(tmp_path / "counts.npy", np.array([3, 0, 2]))
    (tmp_path / "list.json").write_text("[3, 0, 2]")
    (tmp_path / "dict.json").write_text(json.dumps({"counts": [3, 0, 2]}))
    for name in ("counts.npy", "list.json", "dict.json"):
        assert load_token_counts(tmp_path / name, 5).tolist() == [3, 0, 2, 0, 0]


@pytest.mark.parametrize(("name", "content", "message"), [
    ("counts.txt", "3 0 2", "has suffix '.txt': allowed are .npy and .json"),
    ("negative.json", "[3, -1]", "allowed is one non-negative count per token id, at most 5"),
    ("long.json", "[1, 1, 1, 1, 1, 1]", "allowed is one non-negative count per token id, at most 5"),
    ("nested.json", "[[1, 2]]", "allowed is one non-negative count per token id"),
    ("missing.npy", None, "is not a file: allowed is a .npy or .json count per token id"),
])  # fmt: skip
def test_a_bad_count_file_is_refused_in_one_line_naming_it(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=f"^drafter.token_counts='.*{name}' .*{message.replace('.', '[.]')}"):
        load_token_counts(tmp_path / name, 5)


def test_a_truncated_sharegpt_file_gives_every_complete_conversations_turns():
    complete = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
                {"id": "b", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "ok"}]}]  # fmt: skip
    text = json.dumps(complete + [{"id": "c", "conversations": [{"from": "human", "value": "cut off"}]}], indent=2)
    truncated = text[: text.index("cut off") + 3].encode()
    assert list(conversation_texts(truncated)) == ["hi", "hello", "ok"]
    assert list(conversation_texts(truncated, limit=1)) == ["hi", "hello"]


@pytest.mark.slow
def test_the_builtin_count_comes_from_sharegpt_once_then_from_its_hash_named_cache(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from mars_bench.models.sources import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(SMOLLM).path)
    monkeypatch.setenv("MARS_BENCH_CACHE", str(tmp_path))  # the count's cache, after the model is found in the real one
    counts = sharegpt_token_counts(tokenizer, 49152, conversations=50)
    cached = list((tmp_path / "token_counts").glob("*.npy"))
    assert len(cached) == 1 and len(cached[0].stem) == 24
    assert counts.shape == (49152,) and counts.sum() > 10_000
    top = frequent_token_ids(counts, 20).tolist()
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("Ġthe", ",", ".")} <= set(top)

    sharegpt_token_counts(tokenizer, 49152, conversations=20)  # another corpus slice: another name
    assert len(list((tmp_path / "token_counts").glob("*.npy"))) == 2

    def no_download(*args):
        raise AssertionError("the cached count must be used")

    monkeypatch.setattr("mars_bench.tasks.providers.from_package_member", no_download)
    assert np.array_equal(sharegpt_token_counts(tokenizer, 49152, conversations=50), counts)


def reduced(model, ids: list[int]) -> ReducedHeadModel:
    return ReducedHeadModel(model, torch.tensor(ids), model.config.vocab_size)


SUBSET, TOKENS = [0, 4, 17, 50, 95], torch.tensor([1, 5, 9, 2, 7])


def logits_of(model, **options) -> torch.Tensor:
    """``model``'s logits for ``TOKENS`` fed to a fresh cache."""
    from transformers import DynamicCache

    return cached_forward(model, TOKENS, DynamicCache(config=model.config), **options)[0]


def test_the_reduced_head_gives_the_full_heads_logits_on_its_subset_and_minus_infinity_elsewhere():
    model = tiny_model(seed=3)
    cut = reduced(model, SUBSET)
    full, mine = logits_of(model), logits_of(cut)
    assert torch.allclose(mine[:, SUBSET], full[:, SUBSET], atol=1e-5)
    off = torch.ones(model.config.vocab_size, dtype=torch.bool).index_fill_(0, torch.tensor(SUBSET), False)
    assert torch.isneginf(mine[:, off]).all()
    assert torch.allclose(logits_of(cut, last_only=True), mine[-1:], atol=1e-5)
    parents = torch.tensor([-1, 0, 0, 1, 1])
    assert torch.allclose(logits_of(cut, parents=parents)[:, SUBSET], logits_of(model, parents=parents)[:, SUBSET], atol=1e-5)


def test_the_contexts_tokens_get_the_full_heads_logits_until_the_next_context_replaces_them():
    model = tiny_model(seed=3)
    cut = reduced(model, SUBSET)
    full = logits_of(model)
    cut.use_context_tokens([torch.tensor([9, 4, 60, 9])])  # 4 is in the subset already; 9 twice
    assert cut.context_ids.tolist() == [9, 60]
    mine = logits_of(cut)
    assert torch.allclose(mine[:, [*SUBSET, 9, 60]], full[:, [*SUBSET, 9, 60]], atol=1e-5)
    assert torch.isneginf(mine[:, [1, 2, 5, 59]]).all()
    cut.use_context_tokens([torch.tensor([2])])
    again = logits_of(cut)
    assert torch.isneginf(again[:, [9, 60]]).all() and torch.allclose(again[:, 2], full[:, 2], atol=1e-5)
    cut.use_context_tokens([torch.tensor([4, 17])])  # nothing beyond the subset
    assert cut.context_head is None and torch.isneginf(logits_of(cut)[:, 2]).all()


def test_the_context_rows_of_a_quantized_drafter_are_quantized_as_the_whole_quantized_head_quantizes_them():
    model = tiny_model(seed=3)
    quantized_cut = quantized_draft_model(reduced(model, SUBSET), "int4")
    quantized_cut.use_context_tokens([torch.tensor([9, 60, 61])])
    assert is_quantized(quantized_cut.context_head)
    scored, whole = [*SUBSET, 9, 60, 61], quantized_draft_model(model, "int4")
    assert torch.allclose(logits_of(quantized_cut)[:, scored], logits_of(whole)[:, scored], atol=1e-4)


def counted_drafter(tmp_path, **settings):
    """The model drafter over a tiny draft model, its vocabulary cut to the 4 tokens a count file ranks first
    (3, 8, 40, 41)."""
    counts = np.zeros(96)
    counts[[3, 8, 40, 41, 42, 60]] = [9, 8, 7, 6, 5, 4]
    np.save(tmp_path / "counts.npy", counts)
    draft, count_file = tiny_model(seed=7, layers=2), str(tmp_path / "counts.npy")
    return build_drafter("model", model=draft, vocab_size=96, draft_vocab=4, token_counts=count_file, **settings)


def test_the_model_drafter_with_context_tokens_drafts_them_and_only_them_beyond_the_subset(tmp_path):
    drafter = counted_drafter(tmp_path, context_vocab=True)
    prompt, generator = torch.tensor(PROMPTS[1]), torch.Generator().manual_seed(0)
    drafter.begin([prompt])
    (proposal,) = drafter.propose([prompt], [5], SamplingParams(temperature=1.0), [generator])
    allowed = {3, 8, 40, 41, *PROMPTS[1]}
    off = torch.ones(96, dtype=torch.bool).index_fill_(0, torch.tensor(sorted(allowed)), False)
    assert set(proposal.tokens.tolist()) <= allowed
    assert (proposal.dists[:, off] == 0).all() and (proposal.dists[:, [1, 4, 42]] > 0).all()  # the prompt's, off the subset
    drafter.accept([[]])
    grown = torch.cat([prompt, torch.tensor([77])])  # the target emitted 77: the next drafts may repeat it
    assert (drafter.propose([grown], [3], SamplingParams(temperature=1.0), [generator])[0].dists[:, 77] > 0).all()


def test_in_a_batch_each_row_scores_its_own_contexts_tokens_and_drafts_as_alone(tmp_path):
    drafter = counted_drafter(tmp_path, context_vocab=True)
    prompts, sampling = [torch.tensor([1, 5, 9, 2, 7]), torch.tensor([11, 50, 60, 61, 11, 3])], SamplingParams(temperature=1.0)
    alone = []
    for seed, prompt in enumerate(prompts):
        drafter.begin([prompt])
        alone += drafter.propose([prompt], [4], sampling, [torch.Generator().manual_seed(seed)])
    drafter.begin(prompts)
    together = drafter.propose(prompts, [4, 4], sampling, [torch.Generator().manual_seed(seed) for seed in range(2)])
    for row, (mine, theirs) in enumerate([(0, 1), (1, 0)]):
        own, others = set(prompts[mine].tolist()), set(prompts[theirs].tolist())
        assert (together[row].dists[:, sorted(own - {3, 8, 40, 41})] > 0).all()
        assert (together[row].dists[:, sorted(others - own - {3, 8, 40, 41})] == 0).all()  # the other row's tokens: not
        assert together[row].tokens.tolist() == alone[row].tokens.tolist()
        assert torch.allclose(together[row].dists, alone[row].dists, atol=1e-6)


def test_the_model_drafter_over_a_subset_drafts_only_subset_tokens_with_q_zero_elsewhere(tmp_path):
    drafter = counted_drafter(tmp_path)
    prompt = torch.tensor(PROMPTS[1])
    drafter.begin([prompt])
    (proposal,) = drafter.propose([prompt], [5], SamplingParams(temperature=1.0), [torch.Generator().manual_seed(0)])
    assert set(proposal.tokens.tolist()) <= {3, 8, 40, 41}
    off = torch.ones(96, dtype=torch.bool).index_fill_(0, torch.tensor([3, 8, 40, 41]), False)
    assert (proposal.dists[:, off] == 0).all() and torch.allclose(proposal.dists.sum(-1), torch.ones(5))


@pytest.mark.parametrize("name", ["model", "model_tree"])
@pytest.mark.slow
def test_exact_with_a_reduced_draft_vocabulary_reproduces_the_targets_greedy_decode(name, tmp_path):
    target, draft = tiny_model(seed=0), tiny_model(seed=7, layers=2)
    np.save(tmp_path / "counts.npy", np.arange(96)[::-1])  # the 48 lowest ids are the "frequent" ones
    drafter = build_drafter(name, model=draft, vocab_size=96, draft_vocab=48, token_counts=str(tmp_path / "counts.npy"))
    with_prompt = build_drafter(name, model=draft, vocab_size=96, draft_vocab=48, token_counts=str(tmp_path / "counts.npy"),
                                context_vocab=True)  # fmt: skip
    for prompt in PROMPTS:
        baseline = decode(target, None, None, prompt, max_new_tokens=40)
        for chosen in (drafter, with_prompt):
            result = decode(target, chosen, "exact", prompt, max_new_tokens=40, gamma=4)
            assert result.tokens == baseline.tokens
            assert result.drafted > 0


def test_a_head_that_rescales_its_logits_is_refused_in_one_line():
    model = tiny_model(seed=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="^drafter.draft_vocab cannot cut the head of LlamaForCausalLM: allowed are"):
        reduced(model, [1, 2])


@pytest.mark.slow
def test_the_app_drafts_over_a_reduced_vocabulary_and_records_it_in_the_drafter_setting(tmp_path, tiny_target):
    from mars_bench.bench.records import read_rows

    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps(list(range(49152, 0, -1))))  # SmolLM2's vocabulary, the tiny target's too
    settings = ["drafter=model", f"model.target={tiny_target}", f"model.draft_model={tiny_target}", "drafter.draft_vocab=4096",
                f"drafter.token_counts={counts}"]  # fmt: skip
    done = app(*SMOKE, *settings, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    rows = list(read_rows(tmp_path / "run" / "records.jsonl"))
    method = [row for row in rows if row["method"] != "baseline"]
    assert method and all(row["drafter_setting"] == f"gamma=5,draft_vocab=4096,token_counts={counts}" for row in method)


@pytest.mark.parametrize(("settings", "message"), [
    (["drafter.draft_vocab=0"], "drafter.draft_vocab=0 is invalid: allowed is an integer >= 1 or null (all tokens)"),
    (["drafter.draft_vocab=8", "drafter.token_counts=/nowhere/counts.npy"],
     "drafter.token_counts='/nowhere/counts.npy' is not a file: allowed is a .npy or .json count per token id"),
])  # fmt: skip
def test_the_app_refuses_a_bad_draft_vocabulary_in_one_line_before_loading_a_model(settings, message, tmp_path):
    done = app(*SMOKE, "drafter=model", f"model.draft_model={SMOLLM}", *settings, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"mars_bench: error: {message}"
    assert "Loading weights" not in done.stderr  # refused before any model loads
