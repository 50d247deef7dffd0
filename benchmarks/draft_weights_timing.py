"""Time one-token forwards of the 0.5B draft model with bf16, int8 and int4 weights.

    python benchmarks/draft_weights_timing.py [--repeats 15] [--context 250] [--implementations ours torchao]

Qwen2.5-Coder-0.5B-Instruct in bf16, as loaded, then quantized weight-only on the CPU by two
implementations: ``torchao`` (int8: ``Int8WeightOnlyConfig``, which the package uses off the CPU;
int4: the package's CPU layout) and ``ours`` (int8: the package's CPU layer ``Int8Linear``,
``_weight_int8pack_mm``; int4: the hand-written layer torchao replaced, kept here for this
comparison only, ``_weight_int4pack_mm_for_cpu``). This is the measurement behind the package's
choice of each (docs/drafters.md).
Each row is the median of ``--repeats`` one-token cached forwards after ``--context`` cached
tokens, after one warm-up (``perf.costs.forward_seconds``, the suite's forward cost), with the
one-token logits compared to bf16's as a check. Run it on an idle machine: others' work on the
same cores makes the times meaningless.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torchao
from torchao.quantization import quantize_
from transformers import DynamicCache

from mars_bench.drafting.draft_weights import INT4_GROUP, Int8Linear, quantized_linear, torchao_config
from mars_bench.models.kvcache import cached_logits
from mars_bench.models.loading import load_model
from mars_bench.perf.costs import forward_seconds

DRAFT_MODEL = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
IMPLEMENTATIONS = ("ours", "torchao")


class HandWrittenInt4(torch.nn.Module):
    """W as 4-bit codes, an affine grid (min to max in 15 steps) per ``INT4_GROUP`` inputs of a row; the bias is shared."""

    INNER_K_TILES, ROWS = 2, 16

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.compute_dtype = linear.weight.dtype
        self.bias = linear.bias
        outputs, inputs = linear.weight.shape
        self.outputs = outputs
        weight = torch.nn.functional.pad(linear.weight.detach().float(), (0, 0, 0, -outputs % self.ROWS))
        groups = weight.reshape(weight.shape[0], inputs // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        scales_and_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1)  # the kernel: (code - 8) * s + z
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(-1, inputs), self.INNER_K_TILES)
        self.scales_and_zeros = scales_and_zeros.contiguous().to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        out = out[:, : self.outputs].reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias


def torchao_int8(linear: torch.nn.Linear) -> torch.nn.Linear:
    """``linear`` with torchao's int8 weight-only weight, as the package uses off the CPU."""
    layer = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    layer.weight = torch.nn.Parameter(linear.weight.detach(), requires_grad=False)
    quantize_(layer, torchao_config("int8", linear.weight))
    layer.bias = linear.bias
    return layer


def draft_model_with(model: Any, layer: Any) -> Any:
    """A copy of ``model`` whose decoder's and head's linear layers are ``layer(linear)``; the rest shared."""
    memo: dict[int, Any] = {}
    for module in [*model.get_decoder().modules(), model.get_output_embeddings()]:
        if isinstance(module, torch.nn.Linear) and id(module) not in memo:
            memo[id(module)] = layer(module)
    for tensor in [*model.parameters(), *model.buffers()]:
        memo.setdefault(id(tensor), tensor)
    return copy.deepcopy(model, memo)


@torch.inference_mode()
def next_token_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Float logits [V] of the last of ``tokens`` after the others, cached."""
    cache = DynamicCache(config=model.config)
    cached_logits(model, tokens[:-1], cache, last_only=True)
    return cached_logits(model, tokens[-1:], cache)[0].float()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per row (median)")
    parser.add_argument("--context", type=int, default=250, help="cached tokens before the timed one")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--weights", nargs="+", choices=("int8", "int4"), default=["int8", "int4"])
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(DRAFT_MODEL, dtype="bfloat16").model
    tokens = torch.randint(0, model.config.vocab_size, (args.context + 1,), generator=torch.Generator().manual_seed(1))
    reference = next_token_logits(model, tokens)
    layers = {
        ("ours", "int8"): Int8Linear,
        ("ours", "int4"): HandWrittenInt4,
        ("torchao", "int8"): torchao_int8,
        ("torchao", "int4"): lambda linear: quantized_linear(linear, "int4"),
    }
    rows = [("bf16", "as loaded", forward_seconds(model, args.context, 1, repeats=args.repeats), 0.0, True)]
    for implementation in args.implementations:
        for weights in args.weights:
            variant = draft_model_with(model, layers[implementation, weights])
            logits = next_token_logits(variant, tokens)
            error = float((logits - reference).norm() / reference.norm())
            seconds = forward_seconds(variant, args.context, 1, repeats=args.repeats)
            rows.append((weights, implementation, seconds, error, bool(logits.argmax() == reference.argmax())))
            del variant
    print(f"{DRAFT_MODEL}, one-token forward after {args.context} cached tokens, median of {args.repeats} after a "
          f"warm-up, {torch.get_num_threads()} threads, torch {torch.__version__}, torchao {torchao.__version__}")  # fmt: skip
    print(f"| weights | implementation | ms | speedup over bf16 | logits rel. error vs bf16 | same top token |\n|{'---|' * 6}")
    for weights, implementation, seconds, error, same in rows:
        print(f"| {weights} | {implementation} | {seconds * 1000:.1f} | {rows[0][2] / seconds:.2f}x | {error:.4f} | {same} |")


if __name__ == "__main__":
    main()
