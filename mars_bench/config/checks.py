"""The checks of a composed config before any model is loaded: every range and name the schema's types cannot
check, each refused in one line (``check_run_config``)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from mars_bench.common.kernels import check_kernels
from mars_bench.common.settings import cli_value
from mars_bench.config.method import method_spec, shadow_verifiers
from mars_bench.config.schema import VllmGpuConfig
from mars_bench.config.tuning import take_back_tuning
from mars_bench.decoding.engine import DecodeSettings
from mars_bench.drafting import drafter_needs_model, drafters_without_model
from mars_bench.method import MethodSpec, check_tree_judges
from mars_bench.models.placement import check_memory_budget, parse_dtype
from mars_bench.verification import available_verifiers, get_verifier


def check_accuracy_mode(cfg: Any) -> None:
    """Refuse, in one line, ``accuracy_only`` with a lossy verifier unless ``lossy_accuracy`` asks for its accuracy."""
    if cfg.accuracy_only and not get_verifier(cfg.verifier.name).lossless and not cfg.lossy_accuracy:
        raise ValueError(
            f"verifier={cfg.verifier.name} is lossy: accuracy_only scores the target through a lossless verifier "
            f"(allowed: {', '.join(lossless_verifiers())}); add lossy_accuracy=true to score {cfg.verifier.name}'s own answers"
        )


def lossless_verifiers() -> list[str]:
    """The registered verifiers that emit exactly what the target alone would."""
    return [name for name in available_verifiers() if get_verifier(name).lossless]


def check_vllm_settings(cfg: Any) -> None:
    """Refuse, in one line, a ``vllm.*`` value out of range, or any set under a backend other than vLLM's."""
    from mars_bench.backends.vllm import VllmBackend

    settings = cfg.vllm
    if settings.tensor_parallel_size < 1:
        raise ValueError(f"vllm.tensor_parallel_size={settings.tensor_parallel_size} is invalid: allowed is a number of "
                         "GPUs >= 1")  # fmt: skip
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise ValueError(f"vllm.gpu_memory_utilization={settings.gpu_memory_utilization} is invalid: allowed is a share "
                         "of each GPU's memory in (0, 1]")  # fmt: skip
    if settings.gpu_memory_gb is not None and not settings.gpu_memory_gb > 0:
        raise ValueError(f"vllm.gpu_memory_gb={settings.gpu_memory_gb} is invalid: allowed is GiB per GPU > 0, or null "
                         "(read from the GPUs)")  # fmt: skip
    defaults = VllmGpuConfig()
    changed = [item.name for item in fields(VllmGpuConfig) if settings[item.name] != getattr(defaults, item.name)]
    if changed and cfg.backend != VllmBackend.name:
        named = ", ".join(f"vllm.{key}={cli_value(settings[key])}" for key in changed)
        unset = " ".join(f"vllm.{key}={cli_value(getattr(defaults, key))}" for key in changed)
        raise ValueError(f"{named} {'is a setting' if len(changed) == 1 else 'are settings'} of backend={VllmBackend.name}: "
                         f"allowed with backend={cfg.backend} {'is' if len(changed) == 1 else 'are'} {unset}")  # fmt: skip


def check_run_config(cfg: Any, spec: MethodSpec | None = None) -> MethodSpec:
    """Check every range and name before any model is loaded (ValueError, one line), once the drafter tuning is
    taken back where the backend does not take it (``take_back_tuning``: the one change made to ``cfg``).

    Returns the method ``cfg`` names: ``spec``, where the caller has built it from ``cfg`` as taken back
    (``configured_spec``), else built here; the cell runs this one."""
    take_back_tuning(cfg)
    DecodeSettings(cfg.max_new_tokens, cfg.drafter.gamma)
    spec = spec or method_spec(cfg)
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size={cfg.batch_size} is invalid: allowed is an integer >= 1")
    from mars_bench.backends import check_backend_config

    check_vllm_settings(cfg)
    check_backend_config(cfg, spec)
    check_tree_judges(cfg.drafter.name, shadow_verifiers(cfg))
    check_accuracy_mode(cfg)
    if cfg.drafter.name == "eagle3" and not cfg.model.eagle3_head:
        raise ValueError(f"drafter=eagle3 needs model.eagle3_head (a folder or Hub id): model={cfg.model.name} sets none")
    parse_dtype(cfg.model.dtype)
    check_kernels(cfg.model.kernels)
    check_memory_budget(cfg.model.device_map, cfg.model.max_memory)
    if drafter_needs_model(cfg.drafter.name) and not cfg.model.draft_model:
        raise ValueError(
            f"drafter={cfg.drafter.name} needs model.draft_model, which model={cfg.model.name} does not set: "
            f"use a drafter without one ({drafters_without_model()})"
        )
    if cfg.task.num_prompts is not None and cfg.task.num_prompts < 1:
        raise ValueError(f"task.num_prompts={cfg.task.num_prompts} is invalid: allowed is an integer >= 1 or null (all)")
    from mars_bench.tasks import SCORERS
    from mars_bench.tasks.prompting import check_prompting
    from mars_bench.tasks.providers import check_task
    from mars_bench.tasks.safety.scoring import SAFETY_SCORERS, check_safety_scoring

    check_task(cfg.task)
    check_prompting(cfg.task)

    scorers = sorted([*SCORERS, *SAFETY_SCORERS])
    if cfg.task.scorer is not None and cfg.task.scorer not in (*scorers, "judge"):
        raise ValueError(f"task.scorer={cfg.task.scorer!r} is invalid: allowed are {', '.join(scorers)}, judge or null")
    check_safety_scoring(cfg.task)
    if cfg.task.scorer == "judge" and not cfg.task.judge_model:
        raise ValueError("task.scorer=judge needs task.judge_model=<Hub id or folder of the judge model>")
    if cfg.warmup < 0:
        raise ValueError(f"warmup={cfg.warmup} is invalid: allowed is an integer >= 0")
    if cfg.retry_disturbed < 0:
        raise ValueError(f"retry_disturbed={cfg.retry_disturbed} is invalid: allowed is an integer >= 0")
    if not cfg.disturbed_load > 0:
        raise ValueError(f"disturbed_load={cfg.disturbed_load} is invalid: allowed is a number of cores > 0")
    if not 0 < cfg.disturbed_gpu_util <= 100:
        raise ValueError(f"disturbed_gpu_util={cfg.disturbed_gpu_util} is invalid: allowed is a percent in (0, 100]")
    return spec
