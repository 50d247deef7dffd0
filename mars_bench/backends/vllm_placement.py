"""``backend=vllm`` on GPUs: the placement plan checked before any engine loads.

What vLLM 0.34 does with ``tensor_parallel_size`` (TP): it shards the target's attention heads, MLP and vocabulary
over TP GPUs and, unless ``speculative_config`` says ``draft_tensor_parallel_size=1`` (this package never does), the
method's draft model or EAGLE-3 head over the same TP (``SpeculativeConfig._verify_and_get_draft_tp``, called for
every method with a draft checkpoint, ``eagle3`` included). It requires the attention heads of the target, and of the
draft, divisible by TP (``ModelConfig.verify_with_parallel_config``), and keeps max(1, kv_heads // TP) KV heads per
GPU (``ModelConfig.get_num_kv_heads``: KV heads are replicated once TP passes them). At start it takes
``gpu_memory_utilization`` x each GPU's memory for itself and fails to start where the KV cache left in it cannot
hold one ``max_model_len`` sequence.

So each GPU must fit, in ``gpu_memory_utilization`` x its memory (``plan_gpus``, pure over ``GpuFigures``):

- weights: each model's weights / TP, plus what every GPU holds whole (an EAGLE-3 head's ``fc``, a ReplicatedLinear);
- KV cache: one ``max_model_len`` sequence for the target and for the drafter, 2 (keys, values) x layers x
  max(1, kv_heads // TP) x head_dim x dtype bytes x tokens;
- ``RESERVE``, for what vLLM counts in its share beside weights and KV.

The figures come from the models' configs (no weights): ``model_figures`` builds a target or draft model on the meta
device (``placement.model_size_bytes``, tied weights once); ``head_figures`` sizes an EAGLE-3 head from its
config.json by ``drafting.eagle3.checkpoint.head_shapes``, the one table of its tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mars_bench.backends.vllm_memory import GIB, dtype_bytes, gib

# What vLLM 0.34 counts in gpu_memory_utilization beside weights and KV (Worker.determine_available_memory): the peak
# of its profiling forward over max_num_batched_tokens (the worker sets it to max_model_len, 4,096 tokens: the MLP's
# gate and up outputs alone are 4,096 x 2 x intermediate / TP bf16 values, 0.22 GiB for Llama-3.1-8B at TP=1 and for
# Llama-3.3-70B at TP=2), the drafter's and the sampler's dummy runs, and memory outside torch's allocator that grew
# since the engine started (cuBLAS workspaces; NCCL's and custom all-reduce buffers at TP > 1). No CUDA graphs: the
# worker runs with enforce_eager. The CUDA context is outside the share (vLLM requires the free memory at start to
# cover the share). An estimate of about twice those activations, not measured: no GPU was lent to this work.
RESERVE = 2 * GIB
MOST_SUGGESTED_UTILIZATION = 0.95  # above it, too little of the GPU is left for the CUDA context and other processes


@dataclass(frozen=True)
class ModelFigures:
    """One checkpoint an engine loads, sized from its config: bytes at the run's dtype, over all its GPUs together."""

    name: str  # its Hub id or folder
    weights: int  # every tensor vLLM keeps after loading
    replicated: int  # of ``weights``, those every GPU holds whole (not sharded by TP)
    layers: int  # layers with a KV cache
    heads: int  # attention heads (vLLM requires them divisible by TP)
    kv_heads: int
    head_dim: int

    def weights_per_gpu(self, tp: int) -> int:
        """Bytes of weights on each of ``tp`` GPUs."""
        return self.replicated + math.ceil((self.weights - self.replicated) / tp)

    def kv_per_gpu(self, tp: int, tokens: int, width: int) -> int:
        """Bytes of KV cache for one sequence of ``tokens`` on each of ``tp`` GPUs, at ``width`` bytes a value."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * width * tokens


@dataclass(frozen=True)
class GpuFigures:
    """What a plan is made from. ``drafter``: the method's draft model or EAGLE-3 head (None without one);
    ``gpu_memory``: bytes per GPU (the smallest of those used); ``tokens``: vLLM's ``max_model_len``;
    ``dtype``: the weights' and the KV cache's (``model.dtype``)."""

    target: ModelFigures
    drafter: ModelFigures | None
    tensor_parallel: int
    utilization: float
    gpu_memory: int
    tokens: int
    dtype: str
    reserve: int = RESERVE

    @property
    def models(self) -> tuple[ModelFigures, ...]:
        return (self.target,) if self.drafter is None else (self.target, self.drafter)

    @property
    def allowed(self) -> int:
        """Bytes of each GPU vLLM takes for itself: ``utilization`` x its memory."""
        return int(self.utilization * self.gpu_memory)


@dataclass(frozen=True)
class PerGpu:
    """Bytes each GPU needs at one TP."""

    weights: int
    kv: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.reserve


@dataclass(frozen=True)
class GpuPlan:
    """A plan that fits: what each GPU needs, and the run's line saying so."""

    need: PerGpu
    line: str


def per_gpu(figures: GpuFigures, tp: int) -> PerGpu:
    """What each GPU holds with the models sharded over ``tp`` GPUs (see the module)."""
    width = dtype_bytes(figures.dtype)
    return PerGpu(sum(model.weights_per_gpu(tp) for model in figures.models),
                  sum(model.kv_per_gpu(tp, figures.tokens, width) for model in figures.models), figures.reserve)  # fmt: skip


def sharding_sizes(figures: GpuFigures) -> list[int]:
    """The TPs vLLM accepts for these models: those dividing every model's attention heads."""
    heads = math.gcd(*(model.heads for model in figures.models))
    return [tp for tp in range(1, heads + 1) if heads % tp == 0]


def plan_gpus(figures: GpuFigures) -> GpuPlan:
    """The plan where it fits; ValueError, one line, where TP does not divide the heads or each GPU's share of the
    engine does not fit in ``utilization`` x its memory (naming the figures, and the smallest TP or the utilization
    that would fit)."""
    tp = figures.tensor_parallel
    if tp not in (sizes := sharding_sizes(figures)):
        heads = ", ".join(f"{model.heads} of {model.name}" for model in figures.models)
        raise ValueError(f"vllm.tensor_parallel_size={tp} does not divide the attention heads ({heads}), which vLLM "
                         f"shards over the GPUs: allowed are {', '.join(map(str, sizes))}")  # fmt: skip
    need = per_gpu(figures, tp)
    names = " with ".join(model.name for model in figures.models)
    head = (f"vLLM on GPUs: {names} needs {gib(need.total)} per GPU at vllm.tensor_parallel_size={tp} (weights "
            f"{gib(need.weights)}, KV cache of one {figures.tokens}-token sequence {gib(need.kv)}, "
            f"reserve {gib(need.reserve)})")  # fmt: skip
    share = f"vllm.gpu_memory_utilization={figures.utilization:g} of {gib(figures.gpu_memory)}"
    if need.total <= figures.allowed:
        return GpuPlan(need, f"{head}, within the {gib(figures.allowed)} allowed ({share})")
    raise ValueError(f"{head}, more than the {gib(figures.allowed)} allowed ({share}): {what_fits(figures, sizes)}")


def what_fits(figures: GpuFigures, sizes: list[int]) -> str:
    """The smallest larger TP that fits and the utilization that would, in the words of an error's end."""
    fits = []
    larger = next((tp for tp in sizes if tp > figures.tensor_parallel and per_gpu(figures, tp).total <= figures.allowed), None)
    if larger is not None:
        fits.append(f"vllm.tensor_parallel_size={larger} ({gib(per_gpu(figures, larger).total)} per GPU)")
    need = per_gpu(figures, figures.tensor_parallel).total
    utilization = math.ceil(need * 100 / figures.gpu_memory) / 100
    if utilization <= MOST_SUGGESTED_UTILIZATION:
        fits.append(f"vllm.gpu_memory_utilization={utilization:g}")
    if not fits:
        return (f"allowed is a GPU with more memory (no vllm.tensor_parallel_size up to {sizes[-1]} fits, nor a "
                f"vllm.gpu_memory_utilization up to {MOST_SUGGESTED_UTILIZATION:g})")  # fmt: skip
    return f"allowed is {' or '.join(fits)}"


# --- the figures, read from configs and GPUs ------------------------------------------------------


def text_config(config: Any) -> Any:
    """The language model's config of ``config`` (itself, but for a multimodal model's)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_figures(name: str, config: Any, dtype: str) -> ModelFigures:
    """A target or draft model (``config``: its transformers config) sized on the meta device, no weight read."""
    from mars_bench.models.placement import model_size_bytes

    text = text_config(config)
    heads = int(text.num_attention_heads)
    return ModelFigures(name, model_size_bytes(config, dtype), 0, int(text.num_hidden_layers), heads,
                        int(getattr(text, "num_key_value_heads", None) or heads),
                        int(getattr(text, "head_dim", None) or text.hidden_size // heads))  # fmt: skip


def head_figures(name: str, config: dict[str, Any], dtype: str) -> ModelFigures:
    """An EAGLE-3 head (``config``: its config.json) sized by ``head_shapes``: with H its hidden size, D its head_dim,
    kv its KV heads, I its intermediate size, Vd its draft vocabulary and F = 3 x the target's hidden size,
    fc H x F (every GPU holds it whole) + one decoder layer over 2H inputs (q heads x D x 2H, k and v kv x D x 2H each,
    o H x heads x D; MLP 3 x I x H; three norms of H) + a final norm of H + its own lm_head Vd x H + d2t Vd. Not counted:
    the embeddings, which a published head lacks and vLLM takes from the target, and t2d, which vLLM does not load."""
    from mars_bench.drafting.eagle3.checkpoint import EMBED_KEY, head_shapes

    shapes = head_shapes(config)
    width = dtype_bytes(dtype)
    weights = sum(math.prod(shape) for key, shape in shapes.items() if key not in (EMBED_KEY, "t2d")) * width
    heads = int(config["num_attention_heads"])
    return ModelFigures(name, weights, math.prod(shapes["fc.weight"]) * width, int(config.get("num_hidden_layers") or 1),
                        heads, int(config.get("num_key_value_heads") or heads),
                        int(config.get("head_dim") or int(config["hidden_size"]) // heads))  # fmt: skip


def visible_gpus() -> list[int]:
    """The total memory in bytes of each CUDA GPU this process sees (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(index).total_memory for index in range(torch.cuda.device_count())]
