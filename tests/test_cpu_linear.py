"""``model.kernels``: linear layers packed once for oneDNN compute what the stock layers compute, the engine's
greedy equalities hold on packed models, and transformers' own ``generate`` on a stock load gives the tokens
our packed forwards give (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SHARED_DATA, tiny_model

from mars_bench import build_drafter, decode
from mars_bench.common.kernels import check_kernels
from mars_bench.drafting.draft_weights import quantized_draft_model
from mars_bench.models.cpu_linear import auto_dtypes, onednn_runs, pack_linears, packed_weights, unpack_linears, use_kernels

pytestmark = pytest.mark.skipif(not onednn_runs(torch.float32), reason="oneDNN is not built into this torch")
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 3, 3, 8, 1, 4, 40, 41, 42, 3, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_the_stock_layer_computes(dtype, bias):
    if not onednn_runs(dtype):
        pytest.skip(f"oneDNN does not run {dtype} natively on this CPU")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias).to(dtype).requires_grad_(False)
    inputs = [torch.randn(1, 64), torch.randn(5, 64), torch.randn(2, 3, 64)]
    expected = [layer(x.to(dtype)) for x in inputs]
    assert pack_linears(layer).layers == 1
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for x, reference in zip(inputs, expected):
        out = layer(x.to(dtype))
        assert out.shape == reference.shape and out.dtype == dtype
        torch.testing.assert_close(out, reference, **tolerance)
    assert unpack_linears(layer) == 1 and not hasattr(layer, "packed_weight")
    torch.testing.assert_close(layer(inputs[1].to(dtype)), expected[1], atol=0, rtol=0)  # the stock forward again


@pytest.mark.parametrize("bias", [True, False])
def test_a_widened_bf16_layer_computes_a_bf16_product_where_the_cpu_emulates_bf16(monkeypatch, bias):
    """Where oneDNN runs float32 but not bf16 natively, a bf16 layer keeps its stock one-row forward, bit for bit, and
    takes wider inputs through a float32 copy: the products of bf16 numbers, exact in float32, summed in float32."""
    from mars_bench.models import cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_runs", lambda dtype: dtype == torch.float32)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16).requires_grad_(False)
    one_row, wide = torch.randn(1, 1, 64).to(torch.bfloat16), torch.randn(2, 3, 64).to(torch.bfloat16)
    stock_one_row = layer(one_row)
    packed = pack_linears(layer)
    assert (packed.layers, packed.widened, packed.bytes) == (1, 1, 64 * 96 * 4)
    assert packed.describe()["bf16_in_float32_from_rows"] == {"layers": 1, "rows": cpu_linear.WIDE_ROWS}
    assert torch.equal(layer(one_row), stock_one_row)
    summed = (wide.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)).float()
    out = layer(wide)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 96)
    torch.testing.assert_close(out.float(), summed, atol=1e-5, rtol=2**-8)  # one bf16 rounding of the float32 sum
    assert use_kernels(torch.nn.Linear(8, 8).to(torch.bfloat16), "auto").widened == 1  # auto widens bf16 there
    assert unpack_linears(layer) == 1 and not hasattr(layer, "packed_bias")


def test_packing_takes_every_plain_linear_once_and_leaves_the_weights():
    model = tiny_model("qwen2", seed=0)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    first = pack_linears(model)
    assert first.layers == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert first.bytes == sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert pack_linears(model).layers == 0  # packed layers are left as they are
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    assert set(first.describe()) == {"layers", "pack_s", "packed_gb"}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_exact_reproduces_the_baseline_on_packed_models(kind):
    target, other = tiny_model(kind, seed=0), tiny_model("llama", seed=7, layers=2)
    stock = [decode(target, None, None, prompt, max_new_tokens=20).tokens for prompt in PROMPTS]
    pack_linears(target), pack_linears(other)
    drafters = [build_drafter("model", model=other, vocab_size=96), build_drafter("layerskip", target=target, layers=2),
                build_drafter("lookup")]  # fmt: skip
    for prompt, expected in zip(PROMPTS, stock):
        baseline = decode(target, None, None, prompt, max_new_tokens=20)
        assert baseline.tokens == expected  # packing changed no greedy token of these decodes
        for drafter in drafters:
            assert decode(target, drafter, "exact", prompt, max_new_tokens=20, gamma=3).tokens == baseline.tokens


def test_a_quantized_drafter_copies_a_packed_model_and_shares_its_packed_weights():
    model = tiny_model("llama", seed=3, layers=2)
    pack_linears(model)
    quantized = quantized_draft_model(model, "int8")
    assert {id(w) for w in packed_weights(quantized)} <= {id(w) for w in packed_weights(model)}
    ids = torch.tensor([PROMPTS[1]])
    torch.testing.assert_close(quantized(ids).logits, model(ids).logits, atol=0.5, rtol=0.1)  # int8 rounding only


def test_kernels_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match=r"^model.kernels='fast' is unknown: allowed are auto, onednn, stock$"):
        check_kernels("fast")
    model = tiny_model("llama", seed=0)
    assert use_kernels(model, "stock") is None and not packed_weights(model)
    auto = use_kernels(model, "auto")  # float32: packed where the CPU lacks native bf16 (there it runs float32), else stock
    assert (auto.layers if auto else 0) == (4 * 7 + 1 if torch.float32 in auto_dtypes() else 0)
    unpack_linears(model)
    assert use_kernels(model, "onednn").layers == 4 * 7 + 1
    assert auto_dtypes() == ((torch.bfloat16,) if onednn_runs(torch.bfloat16) else (torch.float32, torch.bfloat16))
    if onednn_runs(torch.bfloat16):
        assert use_kernels(tiny_model("llama", seed=0).to(torch.bfloat16), "auto").layers == 4 * 7 + 1
    with pytest.raises(ValueError, match="model.kernels='onednn' found no linear layer it can pack"):
        use_kernels(torch.nn.Sequential(torch.nn.ReLU()), "onednn")
    assert use_kernels(torch.nn.Sequential(torch.nn.ReLU()), "auto") is None


def test_a_run_with_unknown_kernels_is_refused_before_loading(tmp_path):
    from conftest import run_config

    from mars_bench.config.checks import check_run_config

    with pytest.raises(ValueError, match=r"^model.kernels='fast' is unknown"):
        check_run_config(run_config("model.kernels=fast", f"output_dir={tmp_path}"))
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_packed_forwards_give_the_tokens_of_transformers_generate_on_a_stock_load(smollm):
    """SmolLM2-135M in fp32: our AR baseline on packed layers (``model.kernels=onednn``) against ``generate`` on a
    model loaded as a transformers user loads it, on the first committed HumanEval and MT-bench questions."""
    from mars_bench.models.loading import stop_token_ids
    from mars_bench.perf.peer import load_peer, peer_generate, peer_generation_config
    from mars_bench.perf.suite import first_turn_prompts

    auto_packed = smollm.packed is not None  # model.kernels=auto packs float32 only where the CPU lacks native bf16
    assert auto_packed == (torch.float32 in auto_dtypes())
    stock = load_peer(smollm.resolved.path, "float32")
    stops = stop_token_ids(smollm)
    data = str(SHARED_DATA) if SHARED_DATA.is_dir() else None  # else the pinned registry packages
    prompts = [*first_turn_prompts(smollm.tokenizer, "humaneval", 1, data),
               *first_turn_prompts(smollm.tokenizer, "mt_bench", 1, data)]  # fmt: skip
    config = peer_generation_config(32, 0.0, stops, stops[0])
    if not auto_packed:
        assert use_kernels(smollm.model, "onednn").layers > 0
    assert packed_weights(smollm.model) and not packed_weights(stock)
    try:
        for prompt in prompts:
            ours = decode(smollm.model, None, None, prompt, max_new_tokens=32, stop_token_ids=stops).tokens
            assert ours == peer_generate(stock, prompt, config)
    finally:
        if not auto_packed:
            unpack_linears(smollm.model)  # the fixture is shared: as it was loaded


def test_a_copy_sharing_the_packed_weights_keeps_computing():
    model = tiny_model("qwen2", seed=1, layers=2)
    pack_linears(model)
    twin = copy.deepcopy(model, {id(weight): weight for weight in packed_weights(model)})  # oneDNN's copies cannot be copied
    ids = torch.tensor([PROMPTS[0]])
    torch.testing.assert_close(twin(ids).logits, model(ids).logits, atol=0, rtol=0)
