"""Quantized draft weights (``drafter.weights``): the model drafters may run their draft model
with int8 or int4 weight-only linear layers. The quantized layers compute the linear map up to
their rounding, the loaded model is left as it was, and verification is unchanged: ``exact``
reproduces the target's greedy decode token for token, and the drafter reports the q of the
model it drafts with, which is all ``rejection`` needs to stay lossless (the distribution test
in ``test_distribution.py`` holds for any q)."""

from __future__ import annotations

import pytest
import torch
from conftest import is_quantized, tiny_model

from mars_bench import build_drafter, decode
from mars_bench.drafting.draft_vocab import ReducedHeadModel
from mars_bench.drafting.draft_weights import DraftWeightSettings, quantized_draft_model, quantized_linear
from mars_bench.models.kvcache import cached_forward
from mars_bench.verification.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3]]


def linear(inputs: int, outputs: int, bias: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(inputs, outputs, bias=bias).to(dtype).requires_grad_(False)


def relative_error(layer: torch.nn.Module, reference: torch.nn.Linear, rows: int = 3) -> float:
    x = torch.randn(2, rows, reference.in_features, generator=torch.Generator().manual_seed(1)).to(reference.weight.dtype)
    mine, exact = layer(x).float(), reference(x).float()
    assert mine.shape == exact.shape
    return float((mine - exact).norm() / exact.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("weights", "tolerance"), [("int8", 0.01), ("int4", 0.1)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_quantized_layer_computes_the_linear_map_up_to_its_rounding(weights, tolerance, bias, dtype):
    # 50 outputs: int4 packs rows in tiles of 16, the padding's outputs are cut off.
    reference = linear(64, 50, bias, dtype)
    layer = quantized_linear(reference, weights)
    assert layer.bias is reference.bias and type(reference.weight) is torch.nn.Parameter  # shared; the original kept
    assert layer(torch.zeros(1, 64, dtype=dtype)).shape == (1, 50)
    assert layer(torch.zeros(1, 64, dtype=dtype)).dtype == dtype
    assert relative_error(layer, reference) < tolerance


def test_int4_uses_an_affine_grid_per_32_inputs_so_weights_on_that_grid_are_kept_exactly():
    reference = linear(64, 16, bias=False)
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(2)).float()
    codes[:, ::32], codes[:, 1::32] = 0.0, 15.0  # each group spans the whole grid
    scales = torch.rand(16, 2, generator=torch.Generator().manual_seed(3)).repeat_interleave(32, dim=1) + 0.5
    reference.weight.copy_(codes * scales / 64 - 0.1)
    assert relative_error(quantized_linear(reference, "int4"), reference) < 1e-5


def test_int4_refuses_a_layer_whose_inputs_do_not_fill_its_groups_in_one_line():
    message = r"^drafter.weights='int4' cannot pack a linear layer with 48 inputs: allowed are multiples of 32"
    with pytest.raises(ValueError, match=message):
        quantized_linear(linear(48, 16, bias=False), "int4")


def test_a_bad_weights_value_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^drafter.weights='int3' is invalid: allowed are int8, int4 or null \(as loaded\)$"):
        DraftWeightSettings(weights="int3")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_quantized_copy_replaces_every_linear_layer_and_leaves_the_loaded_model_as_it_was(weights):
    model = tiny_model(seed=3)
    tokens = torch.tensor(PROMPTS[1])
    before, _ = cached_forward(model, tokens, _cache(model))
    copy = quantized_draft_model(model, weights)
    assert not any(isinstance(module, torch.nn.Linear) and not is_quantized(module) for module in copy.modules())
    assert sum(is_quantized(module) for module in copy.modules()) == 4 * 7 + 1
    assert all(isinstance(module, torch.nn.Linear) for module in (model.lm_head, model.model.layers[0].mlp.down_proj))
    assert copy.get_input_embeddings().weight is model.get_input_embeddings().weight  # shared, not copied
    assert copy.model.norm.weight is model.model.norm.weight
    after, _ = cached_forward(model, tokens, _cache(model))
    assert torch.equal(after, before)
    quantized, _ = cached_forward(copy, tokens, _cache(model))
    assert 0 < float((quantized - before).norm() / before.norm()) < {"int8": 0.1, "int4": 0.5}[weights]  # 4 layers of rounding
    assert quantized_draft_model(model, None) is model


def test_over_a_reduced_vocabulary_the_cut_head_is_quantized_and_the_unused_full_head_is_not():
    model = tiny_model(seed=3)
    cut = ReducedHeadModel(model, torch.tensor([0, 4, 17, 50, 95]), 96)
    copy = quantized_draft_model(cut, "int4")
    assert is_quantized(copy.get_output_embeddings())
    assert isinstance(copy.model.lm_head, torch.nn.Linear) and copy.model.lm_head.weight is model.lm_head.weight
    logits, _ = cached_forward(copy, torch.tensor(PROMPTS[0]), _cache(model))
    assert torch.isneginf(logits[:, 1]).all() and torch.isfinite(logits[:, [0, 4, 17, 50, 95]]).all()


def test_int4_where_torchao_has_no_kernel_is_refused_in_one_line():
    with torch.device("meta"):
        model = tiny_model(seed=0)
    message = (r"^drafter.weights='int4' has no torchao kernel for a torch.float32 linear layer on meta: "
               r".*; allowed there: int8, null$")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        quantized_draft_model(model, "int4")


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", ["model", "model_tree"])
@pytest.mark.slow
def test_exact_with_quantized_draft_weights_reproduces_the_targets_greedy_decode(name, weights):
    target = tiny_model(seed=0)
    drafter = build_drafter(name, model=tiny_model(seed=0), vocab_size=96, weights=weights)  # the target, quantized
    accepted = 0
    for prompt in PROMPTS:
        baseline = decode(target, None, None, prompt, max_new_tokens=40)
        result = decode(target, drafter, "exact", prompt, max_new_tokens=40, gamma=4)
        assert result.tokens == baseline.tokens
        accepted += result.accepted
    assert accepted > 0  # the drafts were checked, and some were kept


def test_the_quantized_drafter_reports_the_q_of_the_model_it_drafts_with():
    draft = tiny_model(seed=7, layers=2)
    drafter = build_drafter("model", model=draft, vocab_size=96, weights="int4")
    prompt = torch.tensor(PROMPTS[1])
    drafter.begin([prompt])
    (proposal,) = drafter.propose([prompt], [3], SamplingParams(temperature=1.0), [torch.Generator().manual_seed(0)])
    fed = torch.cat([prompt, proposal.tokens[:-1]])
    logits, _ = cached_forward(drafter.model, fed, _cache(draft))
    assert torch.allclose(proposal.dists, torch.softmax(logits[-3:], dim=-1), atol=1e-5)
    unquantized, _ = cached_forward(draft, fed, _cache(draft))
    assert not torch.allclose(proposal.dists, torch.softmax(unquantized[-3:], dim=-1), atol=1e-5)


def _cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@pytest.mark.slow
def test_the_app_drafts_with_int4_weights_and_records_them_in_the_drafter_setting(tmp_path, tiny_target):
    from conftest import SMOKE, app

    from mars_bench.bench.records import read_rows

    settings = ["drafter=model", f"model.target={tiny_target}", f"model.draft_model={tiny_target}", "drafter.weights=int4"]
    done = app(*SMOKE, *settings, f"hydra.run.dir={tmp_path}")
    assert done.returncode == 0, done.stderr
    method = [row for row in read_rows(tmp_path / "records.jsonl") if row["method"] != "baseline"]
    assert method and all(row["drafter_setting"] == "gamma=5,weights=int4" for row in method)
    assert all(row["status"] == "ok" and row["drafted"] > 0 for row in method)


def test_the_app_refuses_bad_draft_weights_in_one_line_before_loading_a_model(tmp_path):
    from conftest import SMOKE, app

    done = app(*SMOKE, "drafter=model", "model.draft_model=HuggingFaceTB/SmolLM2-135M-Instruct", "drafter.weights=int2",
               f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "mars_bench: error: drafter.weights='int2' is invalid: allowed are int8, int4 or null (as loaded)"
    )
    assert "Loading weights" not in done.stderr
