"""Weight-only quantized draft models: the drafter streams int8 or int4 weights instead of bf16.

A one-token forward of a small drafter on a CPU is bound by memory bandwidth: it reads every
weight once and does little arithmetic with it. Storing the drafter's linear layers in int8
(one scale per output row) or int4 (an affine grid per 32 inputs of a row, the sub-block of
GGUF's Q4_K) halves or quarters the bytes read per draft; measured on the reference 2-vCPU
machine over a 0.5B-shaped stack of linear layers, one token: bf16 57 ms, int8 25 ms, int4
11 ms. Activations stay in the model's dtype, and the layers that are not linear maps
(embeddings, norms) are shared with the loaded model, not copied.

Verification is untouched: the drafter's q is whatever the quantized model computes, so
``exact`` stays exact and ``rejection`` stays lossless. The kernels are PyTorch's CPU
weight-only ones (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``); other devices
are refused. Many-token forwards (the prompt's prefill) are slower through these kernels than
through a bf16 matmul, once per prompt.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from mars_bench.settings import OPTIONAL

DRAFT_WEIGHTS = ("int8", "int4")  # besides null: the weights as loaded
INT4_GROUP = 32  # inputs per int4 scale and zero point
INT4_INNER_K_TILES = 2  # the CPU packing's tile parameter (K must be a multiple of 16 * it)
INT4_ROWS = 16  # the CPU packing takes outputs in tiles of this many rows


def check_draft_weights(value: str | None) -> None:
    """``drafter.weights`` is null or one of ``DRAFT_WEIGHTS``."""
    if value is not None and value not in DRAFT_WEIGHTS:
        raise ValueError(f"drafter.weights={value!r} is invalid: allowed are {', '.join(DRAFT_WEIGHTS)} or null (as loaded)")


@dataclass(frozen=True)
class DraftWeightSettings:
    """The model drafters' weight setting (``model``, ``model_tree``).

    weights: null (as loaded), int8 or int4: the draft model's linear layers, head included,
        quantized weight-only for cheaper drafts on the CPU.
    """

    weights: str | None = field(default=None, metadata=OPTIONAL)

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_draft_weights(self.weights)


class WeightOnlyLinear(torch.nn.Module):
    """y = x W^T + b for a ``linear`` layer whose W a subclass stores in codes (``matmul``: rows
    [M, in] in ``compute_dtype`` -> [M, out]); the bias is the layer's own, shared."""

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


class Int8Linear(WeightOnlyLinear):
    """W stored as int8 [out, in] times a per-row scale [out]."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("quantized", quantized.contiguous())
        self.register_buffer("scales", scales.to(self.compute_dtype))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.quantized, self.scales)


class Int4Linear(WeightOnlyLinear):
    """W stored as 4-bit codes: every ``INT4_GROUP`` inputs of a row share a scale and an offset
    (the grid spans the group's min to max in 15 steps)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        outputs, inputs = linear.weight.shape
        if inputs % (16 * INT4_INNER_K_TILES) or inputs % INT4_GROUP:
            raise ValueError(f"drafter.weights='int4' cannot pack a linear layer with {inputs} inputs: allowed are "
                             f"multiples of {max(INT4_GROUP, 16 * INT4_INNER_K_TILES)} (else use int8)")  # fmt: skip
        super().__init__(linear)
        self.outputs = outputs
        padded = -outputs % INT4_ROWS  # the packing takes whole tiles of rows; the padding's outputs are cut off
        weight = torch.nn.functional.pad(linear.weight.detach().float(), (0, 0, 0, padded))
        groups = weight.reshape(outputs + padded, inputs // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        # The kernel computes (code - 8) * scale + zero, so zero = low + 8 * scale.
        scales_and_zeros = torch.stack([scales, low + 8 * scales], dim=-1).transpose(0, 1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.reshape(-1, inputs), INT4_INNER_K_TILES)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(self.compute_dtype))

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, self.scales_and_zeros)
        return out[:, : self.outputs]


QUANTIZED_LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


def quantized_draft_model(model: Any, weights: str | None) -> Any:
    """``model`` itself when ``weights`` is null, else a copy whose linear layers hold ``weights``
    codes: those of its decoder and its output head (``get_output_embeddings``: for a
    ``ReducedHeadModel`` the cut head, so the unused full head is not quantized).

    The copy shares every other parameter and buffer with ``model``, which stays as loaded (the
    same loaded drafter may serve other configurations). Its linear layers must be on the CPU.
    """
    check_draft_weights(weights)
    if weights is None:
        return model
    quantize = QUANTIZED_LINEAR[weights]
    memo: dict[int, Any] = {}
    for module in [*model.get_decoder().modules(), model.get_output_embeddings()]:
        if isinstance(module, torch.nn.Linear) and id(module) not in memo:
            if module.weight.device.type != "cpu":
                raise ValueError(f"drafter.weights={weights!r} runs on the CPU only (PyTorch's weight-only kernels): the "
                                 f"draft model has a linear layer on {module.weight.device}; allowed there: null")  # fmt: skip
            memo[id(module)] = quantize(module)
    for tensor in [*model.parameters(), *model.buffers()]:
        memo.setdefault(id(tensor), tensor)  # shared, not copied
    return copy.deepcopy(model, memo)
