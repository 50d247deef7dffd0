"""Where a model's modules go: device plans checked before loading, and the devices that
drafters and the engine use.

Sharding (tests/test_sharding.py). With ``device_map`` one of auto | balanced | balanced_low_0 |
sequential, the loader first plans the placement on the meta device (the model is built
from its config with no weights, its module sizes measured at the requested dtype, and the
device map inferred against ``max_memory`` by the same transformers/accelerate code that
``from_pretrained`` runs), then checks that the plan fits, and only then loads the weights
with exactly that plan (``plan_before_loading``). A plan fits when every module lands on an
accelerator, or on a place the user allowed explicitly:

- ``cpu``: allowed when ``max_memory`` names "cpu", or when no accelerator is in the plan
  (the CPU is then the main device, not an offload);
- ``disk``: allowed when ``max_memory`` names "disk" (its size is not used by accelerate)
  or an ``offload_folder`` is given.

Anything else raises one ValueError line naming the model, its size in GiB, the memory the
plan had, and what is allowed. For a Hub id the config (one small file) is fetched before
any weights, so an impossible plan fails before a download of hundreds of GB.

Drafter placement: a separate draft model goes on the device of the target's input
embeddings, its first device (``drafter_device``); an EAGLE-3 head goes beside the target's
output head, its last device (``output_device``), as EAGLE places it. The drafter's tokens
feed that embedding, the engine's sampling generator lives on that device (a drafter that
samples must draw from it), and accelerate's top-level hook returns the target's logits to
the input's device, so drafting and verification need no cross-device copy per step;
features an EAGLE head reads from later layers are moved by the head (hidden states are
small: [tokens, hidden]). ``max_memory`` is the target's budget: leave room on the first
device for the drafter and the KV caches.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mars_bench.models.sources import cache_root

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PLANNED_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # device_map values that need a plan
OFFLOAD_PLACES = ("cpu", "disk")
GIB = 2**30


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (float32 | bfloat16 | float16): what a plan is sized at and a model loaded in."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is invalid: allowed are {', '.join(DTYPES)}")
    return DTYPES[name]


# ----------------------------------------------------------------------------- device plans


def _gib(size: float) -> str:
    return f"{size / GIB:.4g} GiB"


def _accelerator_count() -> int:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.device_count()
    return torch.cuda.device_count()


def _accelerator_type() -> str:
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    return current.type if current is not None else "cuda"


def normalise_max_memory(max_memory: dict | None) -> dict[int | str, int | str] | None:
    """``max_memory`` with accelerate's keys: accelerator indices as ints ("0", 0 and
    "cuda:0" all become 0), and "cpu", "mps", "disk"; values stay as given (bytes or "70GiB")."""
    if not max_memory:
        return None
    if not isinstance(max_memory, Mapping):
        raise ValueError(f"model.max_memory={max_memory!r} is invalid: allowed is a mapping of device to size, e.g. {{0: 70GiB}}")
    from accelerate.utils import convert_file_size_to_int

    normalised: dict[int | str, int | str] = {}
    for key, value in dict(max_memory).items():
        name = str(key).strip().lower()
        if ":" in name and name.split(":", 1)[1].isdigit():
            name = name.split(":", 1)[1]
        device: int | str = int(name) if name.isdigit() else name
        if not isinstance(device, int) and device not in ("cpu", "mps", "disk"):
            raise ValueError(
                f"model.max_memory key {key!r} is invalid: allowed are accelerator indices (0, 1, ... or cuda:N), "
                "cpu, mps and disk"
            )
        try:
            size = convert_file_size_to_int(value)
        except (ValueError, TypeError, AttributeError):
            size = -1
        if size < 0:
            raise ValueError(
                f"model.max_memory[{key!r}]={value!r} is invalid: allowed are sizes such as '70GiB', '500MB' or bytes"
            )
        normalised[device] = value
    return normalised


def check_memory_budget(device_map: Any, max_memory: dict | None) -> dict | None:
    """``max_memory`` normalised (``normalise_max_memory``); a ValueError when it is given to a
    ``device_map`` that plans nothing."""
    memory = normalise_max_memory(max_memory)
    if memory is not None and device_map not in PLANNED_MAPS:
        raise ValueError(
            f"model.max_memory is set but device_map={device_map!r}: allowed with max_memory are {', '.join(PLANNED_MAPS)}"
        )
    return memory


@dataclass
class DevicePlan:
    """Where each module of a model goes, decided on the meta device before loading.

    device_map: module (or parameter) name -> accelerator index, "cpu" or "disk", as
        ``from_pretrained`` takes it. size_bytes: the model's weights and buffers at the load
        dtype. memory: the per-device budget in bytes the plan was made against (``max_memory``
        as given, or accelerate's free-memory default). offloaded: bytes placed in "cpu" / "disk"
        while an accelerator is the main device ("disk" also without one).
    """

    device_map: dict[str, int | str]
    size_bytes: int
    memory: dict[int | str, int]
    offloaded: dict[str, int] = field(default_factory=dict)
    offload_folder: str | None = None

    def to_record(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "size_gib": float(f"{self.size_bytes / GIB:.4g}"),
            "memory_bytes": {str(k): v for k, v in self.memory.items()},
            "offloaded_bytes": dict(self.offloaded),
            "offload_folder": self.offload_folder,
        }


def empty_model(config: Any, dtype: torch.dtype) -> Any:
    """The causal LM of ``config`` with every parameter on the meta device (no memory)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def model_size_bytes(config: Any, dtype: str = "bfloat16") -> int:
    """Bytes of weights and buffers of the causal LM of ``config`` at ``dtype`` (tied weights once)."""
    return int(_module_sizes(empty_model(config, parse_dtype(dtype)))[""])


def _module_sizes(model: Any) -> dict[str, int]:
    """Bytes per module and per parameter name ("" = the whole model), tied weights counted once."""
    try:
        from transformers.integrations.accelerate import compute_module_sizes

        return dict(compute_module_sizes(model, only_modules=False)[0])
    except ImportError:
        from accelerate.utils import compute_module_sizes

        return dict(compute_module_sizes(model))


def _infer_device_map(model: Any, device_map: str, max_memory: dict | None) -> dict[str, int | str]:
    """The device map ``from_pretrained(device_map=..., max_memory=...)`` would compute."""
    logger = logging.getLogger("accelerate.utils.modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "Device N is not available" is raised below as one line instead
    try:
        try:
            from transformers.integrations.accelerate import _get_device_map
        except ImportError:  # a later transformers: accelerate's public planner, the same rule
            from accelerate import infer_auto_device_map
            from accelerate.utils import get_balanced_memory, get_max_memory

            no_split = model._no_split_modules
            if device_map == "sequential":
                memory = get_max_memory(max_memory)
            else:
                memory = get_balanced_memory(
                    model, max_memory, no_split_module_classes=no_split, low_zero=device_map == "balanced_low_0"
                )
            return dict(infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split))
        return dict(_get_device_map(model, device_map, max_memory, None))
    finally:
        logger.setLevel(level)


def _main_device(places: list[int | str]) -> int | str:
    """accelerate's main (execution) device: the first place that is not an offload."""
    kept = [place for place in places if place not in OFFLOAD_PLACES]
    ints = sorted(place for place in kept if isinstance(place, int))
    return ints[0] if ints else (kept[0] if kept else "cpu")


def plan_device_map(
    name: str,
    config: Any,
    *,
    dtype: str,
    device_map: str,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
) -> DevicePlan:
    """Plan ``device_map`` (auto | balanced | balanced_low_0 | sequential) for the model of
    ``config`` against ``max_memory`` on the meta device, and raise a one-line ValueError if
    the plan does not fit (see the module docstring). No weights are read."""
    from transformers.integrations.accelerate import get_max_memory

    if device_map not in PLANNED_MAPS:
        raise ValueError(f"device_map={device_map!r} needs no plan: allowed are {', '.join(PLANNED_MAPS)}")
    memory_given = normalise_max_memory(max_memory)
    visible = _accelerator_count()
    for key in memory_given or {}:
        if isinstance(key, int) and key >= visible:
            raise ValueError(
                f"model.max_memory names accelerator {key} for {name}, but this machine has {visible}: "
                f"allowed keys are 0..{visible - 1}, cpu and disk"
            )
    model = empty_model(config, parse_dtype(dtype))
    sizes = _module_sizes(model)
    size = int(sizes[""])
    memory = {k: int(v) for k, v in get_max_memory(copy.deepcopy(memory_given)).items()}
    plan = _infer_device_map(model, device_map, copy.deepcopy(memory_given))
    places = list(dict.fromkeys(plan.values()))
    main = _main_device(places)
    offload_places = [place for place in OFFLOAD_PLACES if place != main]
    offloaded = {place: sum(sizes[key] for key, value in plan.items() if value == place) for place in offload_places}
    offloaded = {place: bytes_ for place, bytes_ in offloaded.items() if bytes_}
    allowed = {"cpu": "cpu" in (memory_given or {}), "disk": "disk" in (memory_given or {}) or offload_folder is not None}
    budget = sum(v for k, v in memory.items() if k != "disk")
    refused = [place for place in offloaded if not allowed[place]]
    if refused or (not allowed["disk"] and budget < size):
        where = ", ".join(f"{_gib(offloaded[place])} to {place}" for place in refused) or "its weights past the budget"
        given = (
            "max_memory=" + str({str(k): v for k, v in memory_given.items()})
            if memory_given
            else "max_memory=None (free memory " + str({str(k): _gib(v) for k, v in memory.items()}) + ")"
        )
        raise ValueError(
            f"model {name} does not fit: it needs {_gib(size)} in {dtype}, {given} allows {_gib(budget)}, "
            f"and device_map={device_map} would offload {where}; allowed: raise model.max_memory, or allow offload explicitly "
            "(CPU: a 'cpu' entry in model.max_memory; disk: a 'disk' entry or model.offload_folder)"
        )
    folder = offload_folder
    if "disk" in plan.values() and folder is None:
        folder = str(cache_root() / "offload" / f"{name.strip('/').replace('/', '--')}-{dtype}")
    return DevicePlan(plan, size, memory, offloaded, folder)


def config_before_weights(name: str) -> Any:
    """The model's config from a folder, the HF cache or the Hub (config.json only), or None:
    what ``plan_device_map`` needs before any weight is downloaded."""
    from transformers import AutoConfig

    from mars_bench.common.hub import hub_online

    try:  # with no Hub, from the folder or the HF cache alone, without the Hub client's retries
        return AutoConfig.from_pretrained(name, local_files_only=not Path(name).is_dir() and not hub_online())
    except Exception:  # offline and uncached, or a mirror-only id: planned after resolving
        return None


# ----------------------------------------------------------------------------- placement


def _as_device(place: Any) -> torch.device:
    if isinstance(place, torch.device):
        return place
    if isinstance(place, int):
        return torch.device(_accelerator_type(), place)
    return torch.device(place)


def _module_name(model: Any, module: Any) -> str | None:
    return next((name for name, candidate in model.named_modules() if candidate is module), None)


def execution_device(model: Any, module: Any = None) -> torch.device:
    """The device ``module`` of ``model`` (default: its input embeddings) computes on.

    Unsharded: the device of its weights. Sharded (``hf_device_map``): its device_map entry,
    where modules offloaded to "cpu" / "disk" run on accelerate's main device (their weights
    then sit on the meta device, so ``weight.device`` would say "meta").
    """
    module = model.get_input_embeddings() if module is None else module
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        name = _module_name(model, module)
        if name is not None:
            matches = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
            if matches:
                place = device_map[max(matches, key=len)]
                if place in OFFLOAD_PLACES:
                    place = _main_device(list(device_map.values()))
                    place = "cpu" if place in OFFLOAD_PLACES else place
                return _as_device(place)
    weight = next(iter(module.parameters()), None)
    if weight is not None and weight.device.type != "meta":
        return weight.device
    return torch.device("cpu")


def input_device(model: Any) -> torch.device:
    """Where the model reads input ids: the device of its input embeddings (its first device)."""
    return execution_device(model)


def output_device(model: Any) -> torch.device:
    """Where the model's head computes the logits (its last device); accelerate's top-level hook
    then returns them to ``input_device``."""
    head = model.get_output_embeddings()
    return execution_device(model, head) if head is not None else input_device(model)


def drafter_device(target: Any) -> torch.device:
    """Where a separate draft model goes: the target's input device (its first device). An
    EAGLE-3 head goes beside the target's lm_head instead (``output_device``)."""
    return input_device(target)


def draft_head_device(target: Any) -> torch.device:
    """Where a draft head that continues the target's last hidden states (EAGLE-3) goes: beside
    the target's lm_head, its last device (``output_device``), as EAGLE places it."""
    return output_device(target)


def placement(model: Any) -> dict[str, Any]:
    """Where ``model`` lives, for manifests: the device_map (module -> place) when sharded,
    the input / output devices, and the places that hold offloaded weights."""
    device_map = getattr(model, "hf_device_map", None) or None
    record: dict[str, Any] = {
        "device_map": {name: str(place) for name, place in device_map.items()} if device_map else None,
        "input_device": str(input_device(model)),
        "output_device": str(output_device(model)),
    }
    places = list(device_map.values()) if device_map else []
    main = _main_device(places)
    record["offloaded_modules"] = {place: places.count(place) for place in OFFLOAD_PLACES if place != main and place in places}
    return record
