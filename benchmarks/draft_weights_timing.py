"""Time one-token forwards of the 0.5B draft model with bf16, int8 and int4 weights.

    python benchmarks/draft_weights_timing.py [--repeats 15] [--context 250] [--implementations handwritten torchao]

Qwen2.5-Coder-0.5B-Instruct in bf16, as loaded, then quantized weight-only by two implementations
of ``drafter.weights``: ``torchao`` (the package's ``drafting/draft_weights.py``) and
``handwritten`` (the linear layers it replaced, kept here for this comparison only: int8 codes
through ``_weight_int8pack_mm``, int4 through ``_weight_int4pack_mm_for_cpu``, both CPU-only).
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
from transformers import DynamicCache

from mars_bench.drafting.draft_weights import INT4_GROUP, quantized_draft_model
from mars_bench.kvcache import cached_logits
from mars_bench.models import load_model
from mars_bench.perf.costs import forward_seconds

DRAFT_MODEL = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
IMPLEMENTATIONS = ("handwritten", "torchao")


class HandWrittenLinear(torch.nn.Module):
    """y = x W^T + b with W in codes (``matmul``: rows [M, in] in ``compute_dtype`` -> [M, out]); the bias is shared."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.compute_dtype = linear.weight.dtype
        self.bias = linear.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        out = self.matmul(rows).reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias


class HandWrittenInt8(HandWrittenLinear):
    """W as int8 [out, in] times a per-row scale [out]."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(self.compute_dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.quantized, self.scales)


class HandWrittenInt4(HandWrittenLinear):
    """W as 4-bit codes, an affine grid (min to max in 15 steps) per ``INT4_GROUP`` inputs of a row."""

    INNER_K_TILES, ROWS = 2, 16

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
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

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        return out[:, : self.outputs]


def handwritten_draft_model(model: Any, weights: str) -> Any:
    """A copy of ``model`` with its decoder's and head's linear layers hand-quantized; the rest shared."""
    layer = {"int8": HandWrittenInt8, "int4": HandWrittenInt4}[weights]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per row (median)")
    parser.add_argument("--context", type=int, default=250, help="cached tokens before the timed one")
    parser.add_argument("--implementations", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    parser.add_argument("--weights", nargs="+", choices=("int8", "int4"), default=["int8", "int4"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(DRAFT_MODEL, dtype="bfloat16").model
    tokens = torch.randint(0, model.config.vocab_size, (args.context + 1,), generator=torch.Generator().manual_seed(1))
    reference = next_token_logits(model, tokens)
    build = {"handwritten": handwritten_draft_model, "torchao": quantized_draft_model}
    rows = [("bf16", "as loaded", forward_seconds(model, args.context, 1, repeats=args.repeats), 0.0, True)]
    for implementation in args.implementations:
        for weights in args.weights:
            variant = build[implementation](model, weights)
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
