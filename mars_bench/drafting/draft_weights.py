"""Weight-only quantized draft models: the drafter streams int8 or int4 weights instead of bf16.

A one-token forward of a small drafter on a CPU is bound by memory bandwidth: it reads every
weight once and does little arithmetic with it, so fewer bytes per weight make cheaper drafts.
Each linear layer of the draft model, its output head included, is replaced in a copy of the
model; activations stay in the model's dtype, and the layers that are not linear maps
(embeddings, norms) and every bias are shared with the loaded model.

- int4: an asymmetric grid per 32 inputs of a row (``INT4_GROUP``, the sub-block of GGUF's
  Q4_K), by torchao. On the CPU, torchao's CPU layout (``PrototypeInt4WeightOnlyConfig``:
  PyTorch's ``_weight_int4pack_mm_for_cpu``; its packing takes outputs in tiles of
  ``INT4_ROWS``, so a layer is packed with zero rows appended and their outputs cut off). On
  CUDA, torchao's tinygemm layout (``Int4WeightOnlyConfig``, ``tile_packed_to_4d``), bfloat16
  models only. No other device has a kernel.
- int8: one symmetric scale per output row. On the CPU our own layer (``Int8Linear``: PyTorch's
  ``_weight_int8pack_mm``), because torchao's eager int8 linear converts the whole weight back
  to the activation dtype on every call and ran a one-token forward of the 0.5B drafter 3.3x
  slower than it (``benchmarks/draft_weights_timing.py``; docs/drafters.md has the numbers);
  elsewhere torchao's ``Int8WeightOnlyConfig``.

Verification is untouched: the drafter's q is whatever the quantized model computes, so
``exact`` stays exact and ``rejection`` stays lossless. Many-token forwards (the prompt's
prefill) can be slower through these kernels than through a bf16 matmul, once per prompt.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from mars_bench.common.settings import OPTIONAL
from mars_bench.models.cpu_linear import packed_weights

DRAFT_WEIGHTS = ("int8", "int4")  # besides null: the weights as loaded
INT4_GROUP = 32  # inputs per int4 scale and zero point
INT4_ROWS = 16  # the CPU int4 packing takes outputs in tiles of this many rows


def check_draft_weights(value: str | None) -> None:
    """``drafter.weights`` is null or one of ``DRAFT_WEIGHTS``."""
    if value is not None and value not in DRAFT_WEIGHTS:
        raise ValueError(f"drafter.weights={value!r} is invalid: allowed are {', '.join(DRAFT_WEIGHTS)} or null (as loaded)")


@dataclass(frozen=True)
class DraftWeightSettings:
    """The model drafters' weight setting (``model``, ``model_tree``).

    weights: null (as loaded), int8 or int4: the draft model's linear layers, head included,
        quantized weight-only (torchao) for cheaper drafts.
    """

    weights: str | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_draft_weights(self.weights)


class Int8Linear(torch.nn.Module):
    """y = x W^T + b with W stored as int8 [out, in] times a per-row scale [out], on the CPU; the
    bias is the linear layer's own, shared."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.compute_dtype = linear.weight.dtype
        self.bias = linear.bias
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("quantized", quantized.contiguous())
        self.register_buffer("scales", scales.to(self.compute_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(self.compute_dtype)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.quantized, self.scales).reshape(*x.shape[:-1], -1).to(x.dtype)
        return out if self.bias is None else out + self.bias


def torchao_config(weights: str, weight: torch.Tensor) -> Any:
    """The torchao config that quantizes ``weight`` (a linear layer's [out, in]) to ``weights``
    where it lies; ValueError in one line where torchao has no kernel for it."""
    import torchao.quantization as quantization

    if weights == "int8":  # off the CPU (``quantized_linear``)
        return quantization.Int8WeightOnlyConfig(set_inductor_config=False)
    inputs, device = weight.shape[1], weight.device
    if inputs % INT4_GROUP:
        raise ValueError(f"drafter.weights='int4' cannot pack a linear layer with {inputs} inputs: allowed are "
                         f"multiples of {INT4_GROUP} (else use int8)")  # fmt: skip
    if device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=INT4_GROUP, set_inductor_config=False)
    if device.type == "cuda" and weight.dtype == torch.bfloat16:
        return quantization.Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                                 set_inductor_config=False)  # fmt: skip
    raise ValueError(f"drafter.weights='int4' has no torchao kernel for a {weight.dtype} linear layer on {device}: allowed "
                     f"are the CPU, or CUDA with a bfloat16 draft model; allowed there: int8, null")  # fmt: skip


def quantized_linear(linear: torch.nn.Linear, weights: str) -> torch.nn.Module:
    """A new layer computing ``linear`` with its weight quantized to ``weights``, on the layer's
    device (``Int8Linear`` for int8 on the CPU, else a linear layer holding a torchao weight); the
    bias is ``linear``'s own, shared, and ``linear`` is left as it was."""
    check_draft_weights(weights)
    if weights == "int8" and linear.weight.device.type == "cpu":
        return Int8Linear(linear)
    from torchao.quantization import quantize_

    config = torchao_config(weights, linear.weight)
    weight, outputs = linear.weight.detach(), linear.out_features
    padded = -outputs % INT4_ROWS if weights == "int4" and weight.device.type == "cpu" else 0
    layer = torch.nn.Linear(linear.in_features, outputs, bias=False, device="meta")
    layer.weight = torch.nn.Parameter(torch.nn.functional.pad(weight, (0, 0, 0, padded)) if padded else weight,
                                      requires_grad=False)  # fmt: skip
    quantize_(layer, config)
    if padded:  # the same packed rows read as a weight of ``outputs`` rows: torchao's linear cuts the others off
        packed = layer.weight
        layer.weight = torch.nn.Parameter(type(packed)(packed.qdata, packed.scale_and_zero, packed.block_size, weight.shape),
                                          requires_grad=False)  # fmt: skip
    layer.bias = linear.bias
    return layer


def quantized_draft_model(model: Any, weights: str | None) -> Any:
    """``model`` itself when ``weights`` is null, else a copy whose linear layers hold ``weights``
    weights (``quantized_linear``): those of its decoder and its output head
    (``get_output_embeddings``: for a ``ReducedHeadModel`` the cut head, so the unused full head is
    not quantized).

    The copy shares every other parameter and buffer with ``model``, which stays as loaded (the
    same loaded drafter may serve other configurations).
    """
    check_draft_weights(weights)
    if weights is None:
        return model
    memo: dict[int, Any] = {}
    for module in [*model.get_decoder().modules(), model.get_output_embeddings()]:
        if isinstance(module, torch.nn.Linear) and id(module) not in memo:
            memo[id(module)] = quantized_linear(module, weights)
    for tensor in [*model.parameters(), *model.buffers(), *packed_weights(model)]:
        memo.setdefault(id(tensor), tensor)  # shared, not copied
    quantized = copy.deepcopy(model, memo)
    if hasattr(quantized, "row_layer"):  # a ReducedHeadModel's context-token rows, quantized like its cut head
        quantized.row_layer = functools.partial(quantized_linear, weights=weights)
    return quantized
