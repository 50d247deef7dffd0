"""Linear layers whose weights are packed once for oneDNN, for forwards on the CPU.

On the CPU a decoder's forward at small batch is mostly the matrix products of its linear layers.
PyTorch's stock linear gives oneDNN (or MKL) the weight in its plain [out, in] layout on every call;
packing it once, at load, into the blocked layout the kernel reads is what vLLM's CPU engine does
(``create_onednn_mm`` at load, ``onednn_mm`` per call) and what inductor's freezing pass does
(``mkldnn._reorder_linear_weight`` then ``mkldnn._linear_pointwise``). ``pack_linears`` does the same in
eager mode with those two PyTorch operators, so the model code, the cache and every hook stay as they
are: a packed layer keeps its weight (tied heads, quantizers and reduced draft heads read it) and
computes through its packed copy.
"""

from __future__ import annotations

import time
import types
import warnings
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from mars_bench.common.kernels import check_kernels

# Rows the packed layout is chosen for; any row count runs. A layout for 1 row is as fast at one token but loses
# its gain above 16 rows (a verification forward is B x (gamma + 1) rows); one for 16 holds it to 32
# (benchmarks/results/forward_kernels_cpu).
PACK_BATCH_HINT = 16
# Rows (tokens over the batch) from which a bfloat16 layer on a CPU that emulates bf16 computes through a float32
# packed copy of its weight (``widened_forward``); fewer stay bf16, whose one-row product is the faster there.
WIDE_ROWS = 2


def auto_dtypes() -> tuple[torch.dtype, ...]:
    """What ``model.kernels=auto`` packs on this CPU. Where the CPU multiplies bfloat16 natively, bfloat16 (packed,
    faster at every width; float32 there was no faster at one token: the embedded target 272.8 -> 272.0 ms a
    forward, its drafter 94.8 -> 103.6 ms, on an Intel Xeon with AMX). Where it does not, float32 (packed, faster
    at every width on an AVX2-only AMD EPYC: the target 503 -> 378 ms at one token, 1792 -> 501 ms at six, its
    drafter 156 -> 132 ms) and bfloat16 through float32 copies for wide forwards (``widened_forward``: there a
    bf16 product costs about one more forward per row, the target 199 ms at one token, 3312 ms at 21).
    benchmarks/results/forward_kernels_cpu."""
    return (torch.bfloat16,) if onednn_runs(torch.bfloat16) else (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class PackedLinears:
    """What ``pack_linears`` did: layers packed, seconds it took, bytes the packed copies hold, and of those layers
    the bfloat16 ones packed in float32 for their wide forwards (``widened_forward``)."""

    layers: int
    seconds: float
    bytes: int
    widened: int = 0

    def describe(self) -> dict[str, Any]:
        described = {"layers": self.layers, "pack_s": round(self.seconds, 3), "packed_gb": round(self.bytes / 2**30, 3)}
        if self.widened:
            described["bf16_in_float32_from_rows"] = {"layers": self.widened, "rows": WIDE_ROWS}
        return described


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run a ``dtype`` linear layer on this CPU in hardware: float32 anywhere oneDNN is
    built in, bfloat16 only with native bf16 instructions (``avx512_bf16``, AMX, or an Arm CPU's)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a layer of weights in ``dtype`` is packed in on this CPU: its own where oneDNN runs it natively;
    float32 for bfloat16 where oneDNN runs float32 but emulates bf16 (``widened_forward``); None: not packed."""
    if onednn_runs(dtype):
        return dtype
    return torch.float32 if dtype == torch.bfloat16 and onednn_runs(torch.float32) else None


def packable(module: torch.nn.Module) -> bool:
    """A plain ``nn.Linear`` (not a subclass, not a quantized weight) on the CPU in a dtype ``packed_dtype`` packs."""
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return (type(weight.data) is torch.Tensor and weight.device.type == "cpu" and weight.layout == torch.strided
            and packed_dtype(weight.dtype) is not None)  # fmt: skip


def packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the layer's packed weight (any leading shape of ``x``)."""
    return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def widened_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of a bfloat16 layer on a CPU that emulates bf16: fewer than ``WIDE_ROWS`` rows as the
    stock layer computes them, wider inputs through the float32 packed copy of the weight, on ``x`` in float32,
    rounded back to bfloat16. A product of two bf16 numbers is exact in float32, so this is a bf16 matrix product
    accumulated in float32, as native bf16 kernels accumulate; only the order of the sums differs."""
    if x.numel() < WIDE_ROWS * x.shape[-1]:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    wide = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_weight, self.packed_bias, "none", [], "")
    return wide.to(x.dtype)


def pack_linears(model: torch.nn.Module, batch_hint: int = PACK_BATCH_HINT) -> PackedLinears:
    """Pack every packable linear layer of ``model`` for oneDNN (in place; layers packed before are left
    as they are). The weights stay; the packed copies add their size in the packed dtype (``packed_dtype``: twice a
    bf16 weight's where it is widened to float32)."""
    started, layers, size, widened = time.perf_counter(), 0, 0, 0
    with torch.no_grad():
        for module in model.modules():
            if not packable(module) or hasattr(module, "packed_weight"):
                continue
            dtype = packed_dtype(module.weight.dtype)
            weight = module.weight.detach().to(dtype)
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            forward = packed_forward
            if dtype != module.weight.dtype:
                module.packed_bias = None if module.bias is None else module.bias.detach().to(dtype)
                forward, widened = widened_forward, widened + 1
            module.forward = types.MethodType(forward, module)
            layers += 1
            size += weight.numel() * weight.element_size()
    return PackedLinears(layers, time.perf_counter() - started, size, widened)


def packed_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The packed copies ``pack_linears`` attached to ``model``'s layers (neither parameters nor buffers:
    a copy of the model that should share them must be told, e.g. through ``copy.deepcopy``'s memo)."""
    return [module.packed_weight for module in model.modules() if hasattr(module, "packed_weight")]


def unpack_linears(model: torch.nn.Module) -> int:
    """Undo ``pack_linears`` (the layers compute from their weights again); how many layers were packed."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            del module.packed_weight
            if hasattr(module, "packed_bias"):
                del module.packed_bias
            del module.forward  # the instance's override: the class's forward shows through again
            count += 1
    return count


def packable_bytes(model: torch.nn.Module) -> int:
    """Bytes the packed copies of ``model``'s packable layers would hold (about their weights' size in the packed
    dtype)."""
    layers = [m for m in model.modules() if packable(m) and not hasattr(m, "packed_weight")]
    return sum(m.weight.numel() * packed_dtype(m.weight.dtype).itemsize for m in layers)


def use_kernels(model: torch.nn.Module, kernels: str) -> PackedLinears | None:
    """Apply ``model.kernels`` to a loaded model: ``onednn`` packs its linear layers where ``packable``
    (ValueError where none is); ``auto`` packs those of the dtype ``auto_dtypes`` names, and not where the packed
    copies would take more than half the memory still available (a warning says so); ``stock`` leaves it.
    None where nothing was packed."""
    check_kernels(kernels)
    if kernels == "stock":
        return None
    if kernels == "auto" and not any(packable(m) and m.weight.dtype in auto_dtypes() for m in model.modules()):
        return None
    needed, available = packable_bytes(model), psutil.virtual_memory().available
    if kernels == "auto" and needed > available / 2:
        warnings.warn(f"model.kernels=auto left the linear layers stock: packing them would take {needed / 2**30:.1f} "
                      f"GiB of the {available / 2**30:.1f} GiB available (model.kernels=onednn packs anyway)",
                      stacklevel=2)  # fmt: skip
        return None
    packed = pack_linears(model)
    if packed.layers:
        return packed
    if kernels == "onednn":
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
        raise ValueError(f"model.kernels='onednn' found no linear layer it can pack (CPU, oneDNN with native "
                         f"{'/'.join(dtypes)}): allowed here are auto, stock")  # fmt: skip
    return None
