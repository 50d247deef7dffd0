"""The transformers backend: this package's own engine (``decoding/``) on models loaded with transformers.

Models stay loaded across the cells of a multirun in one process (``cached_model``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, ClassVar

from mars_bench.backends.base import Backend, PreparedMethod, Requests
from mars_bench.common.kernels import DEFAULT_KERNELS, EARLIER_KERNELS
from mars_bench.decoding import DecodeResult
from mars_bench.decoding.batched import decode_batch
from mars_bench.drafting import drafter_needs_model
from mars_bench.method import MethodSpec
from mars_bench.models.loading import LoadedModel, check_tokenizers_compatible, load_model, stop_token_ids
from mars_bench.models.placement import drafter_device, input_device


def cached_model(
    name: str,
    dtype: str,
    device_map: str | None,
    attn: str,
    max_memory: tuple | None = None,
    offload_folder: str | None = None,
    kernels: str = DEFAULT_KERNELS,
) -> LoadedModel:
    """Models stay loaded across the cells of a multirun in one process: one load per distinct
    (name, dtype, device_map, attn, max_memory, offload_folder, kernels), however the call spells it (a
    draft model equal to the target is the target's object).

    max_memory: a tuple of (device, size) pairs (hashable); offload_folder allows disk offload; kernels:
    ``model.kernels``."""
    return _loaded(name, dtype, device_map, attn, max_memory, offload_folder, kernels)


@lru_cache(maxsize=4)
def _loaded(
    name: str, dtype: str, device_map: str | None, attn: str, max_memory: tuple | None, offload_folder: str | None,
    kernels: str,
) -> LoadedModel:  # fmt: skip
    return load_model(
        name,
        dtype=dtype,
        device_map=device_map,
        attn_implementation=attn,
        max_memory=dict(max_memory) if max_memory else None,
        offload_folder=offload_folder,
        kernels=kernels,
    )


def forget_loaded_models() -> None:
    """Drop the models ``cached_model`` holds (the next call loads afresh)."""
    _loaded.cache_clear()


def load_models(cfg: Any) -> dict[str, LoadedModel]:
    """The target (sharded per model.device_map / max_memory, its plan checked before loading)
    and, for drafter=model, the draft model on the target's input device (``drafter_device``)."""
    m = cfg.model
    memory = tuple(sorted(((str(k), v) for k, v in m.max_memory.items()), key=str)) if m.max_memory else None
    offload_folder = getattr(m, "offload_folder", None)
    kernels = getattr(m, "kernels", EARLIER_KERNELS)  # a config older than model.kernels ran the stock layers
    models = {"target": cached_model(m.target, m.dtype, m.device_map, m.attn_implementation, memory, offload_folder, kernels)}
    if drafter_needs_model(cfg.drafter.name):
        # Unsharded targets keep the default device; sharded ones get the drafter beside their first device.
        place = str(drafter_device(models["target"].model)) if m.device_map else None
        models["drafter"] = cached_model(m.draft_model, m.dtype, place, m.attn_implementation, None, None, kernels)
        check_tokenizers_compatible(models["target"].tokenizer, models["drafter"].tokenizer)
    return models


class TransformersBackend(Backend):
    """The engine of ``decoding/`` on the cell's target (and draft model), loaded with transformers."""

    name: ClassVar[str] = "transformers"
    own_engine: ClassVar[bool] = True

    def __init__(self, cfg: Any) -> None:
        self.loaded = load_models(cfg)
        self.target = self.loaded["target"]
        self.eagle3_head = cfg.model.eagle3_head

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return tuple(stop_token_ids(self.target))

    @property
    def device(self) -> Any:
        return input_device(self.target.model)

    def models(self) -> dict[str, LoadedModel]:
        return self.loaded

    def prepare(self, label: str, spec: MethodSpec) -> PreparedMethod:
        """The spec's verifier and drafter (both None for the baseline), built on the loaded models."""
        draft_model = self.loaded.get("drafter")
        drafter = spec.build_drafter(self.target.model, draft_model.model if draft_model else None,
                                     head=self.eagle3_head, tokenizer=self.tokenizer)  # fmt: skip
        return PreparedMethod(label, spec, (drafter, spec.build_verifier()))

    def describe(self, method: PreparedMethod) -> dict[str, Any]:
        drafter, verifier = method.handle
        return {"drafter": drafter.describe() if drafter is not None else None,
                "verifier": verifier.describe() if verifier is not None else None}  # fmt: skip

    def forward_modules(self, method: PreparedMethod) -> dict[str, Any]:
        drafter, _ = method.handle
        modules = {"target": self.target.model}
        if drafter is not None and method.spec.needs_draft_model:
            modules["drafter"] = drafter.model
        return modules

    def generate(self, method: PreparedMethod, requests: Requests) -> list[DecodeResult]:
        drafter, verifier = method.handle
        settings = {"max_new_tokens": requests.max_new_tokens, "stop_token_ids": requests.stop_token_ids,
                    "stop_when": requests.stop_when, "shadow": list(requests.shadows) if method.judged else (),
                    "fidelity": requests.fidelity and method.judged, **method.spec.decode_kwargs()}  # fmt: skip
        return decode_batch(self.target.model, drafter, verifier, list(requests.prompts), seeds=list(requests.seeds),
                            on_tokens=requests.on_tokens, **settings)  # fmt: skip
