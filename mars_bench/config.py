"""The structured config schema (registered in Hydra's ConfigStore).

A misspelt key or a value of the wrong type fails at start with Hydra's own message;
values that types cannot check (ranges, names) are checked by ``check_run_config``
before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from mars_bench.decoding.draft_length import draft_length_policy
from mars_bench.decoding.engine import DecodeSettings
from mars_bench.drafting import check_drafter_name
from mars_bench.drafting.model import SEPARATE_MODEL_DRAFTERS, check_min_confidence
from mars_bench.drafting.tree import TreeShape
from mars_bench.models import check_memory_budget, parse_dtype
from mars_bench.verification import get_verifier
from mars_bench.verification.sampling import SamplingParams


@dataclass
class ModelConfig:
    """A target and (for drafter=model) its separate draft model, by Hub id or local folder."""

    name: str = "qwen2.5-coder-1.5b"
    target: str = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    draft_model: str | None = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    eagle3_head: str | None = None  # the EAGLE-3 draft head for drafter=eagle3 (a folder or Hub id)
    dtype: str = "bfloat16"
    device_map: str | None = None
    max_memory: dict[Any, str] | None = None  # per device (0, 1, ..., cpu, disk): the target's budget
    offload_folder: str | None = None  # a folder allows disk offload
    attn_implementation: str = "sdpa"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DrafterConfig:
    name: str = "model"
    gamma: int = 5  # drafted tokens per step
    layers: int | None = None  # layerskip depth (default: a quarter of the target's layers)
    max_ngram: int = 3  # lookup
    min_ngram: int = 1
    length: str = "fixed"  # draft-length policy: fixed | schedule (adapts to acceptance) | confidence
    max_gamma: int = 16  # schedule: the most drafts per step
    min_confidence: float = 0.4  # confidence: stop drafting after a token the drafter gives q below this
    top_k: int = 10  # tree drafters (model_tree, eagle3): children per expanded node, nodes expanded per depth
    tree_tokens: int = 50  # tree drafters: the root plus every drafted node (EAGLE's total_token); gamma is the depth


@dataclass
class VerifierConfig:
    name: str = "mars"
    theta: float | None = 0.9
    guard: str = "never"
    correction: str = "residual"
    epsilon: float = 0.09
    delta: float = 0.3


TREE_DRAFTERS = ("model_tree", "eagle3")

# The DrafterConfig keys that shape each drafter's drafts; the records carry them (``drafter_setting``)
# so that an analysis tells two shapes of one drafter apart. A drafter not listed here is shaped by gamma.
DRAFTER_PARAMS = {
    "none": (),
    "model": ("gamma",),
    "model_tree": ("gamma", "top_k", "tree_tokens"),
    "eagle3": ("gamma", "top_k", "tree_tokens"),
    "layerskip": ("gamma", "layers"),
    "lookup": ("gamma", "min_ngram", "max_ngram"),
}

VERIFIER_PARAMS = {
    "exact": (),
    "rejection": (),
    "mars": ("theta", "guard", "correction"),
    "mars_ref": ("theta",),
    "typical": ("epsilon", "delta"),
}


@dataclass
class TaskConfig:
    name: str = "humaneval"
    file: str = "humaneval/question.jsonl"  # absolute, or relative to data_dir
    sources: list[str] = field(default_factory=lambda: ["file", "hub", "package"])  # tried in this order
    num_prompts: int | None = 10  # the first N questions; null = all
    system_prompt: str | None = None
    scorer: str | None = None
    judge_model: str | None = None  # for scorer=judge: any causal LM, by Hub id or folder
    judge_max_new_tokens: int = 512


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0
    warmup: int = 1  # warm-up decodes per method before timing (on a short prompt)
    threads: int | None = None  # torch CPU threads; null = all cores
    data_dir: str | None = None  # null: $MARS_BENCH_DATA, else ../shared/data beside the repository
    output_dir: str | None = None  # null: Hydra's run folder
    progress: bool = True
    shadow: list[str] = field(default_factory=list)  # verifiers judged beside the live one (same drafts, same logits)
    baseline_cache: str | None = None  # a folder shared by the cells of a sweep: each baseline decoded once


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="drafter", name="drafter_schema", node=DrafterConfig)
    store.store(group="verifier", name="verifier_schema", node=VerifierConfig)
    store.store(group="task", name="task_schema", node=TaskConfig)


def verifier_params(verifier: Any) -> dict[str, Any]:
    """The settings the named verifier takes, from a VerifierConfig."""
    if verifier.name not in VERIFIER_PARAMS:
        get_verifier(verifier.name)  # raises the one-line unknown-name error
    return {key: getattr(verifier, key) for key in VERIFIER_PARAMS[verifier.name]}


def drafter_setting(drafter: Any) -> str:
    """The drafter's shaping keys from a DrafterConfig as ``key=value`` pairs, e.g. ``gamma=5,top_k=3,tree_tokens=16``."""
    return ",".join(f"{key}={getattr(drafter, key)}" for key in DRAFTER_PARAMS.get(drafter.name, ("gamma",)))


def max_draft_depth(drafter: Any) -> int:
    """The deepest draft a draft-length schedule may ask for: ``max_gamma``, and for a tree no
    deeper than its node budget holds (``tree_tokens - 1``), so the schedule never runs ahead of it."""
    if drafter.name in TREE_DRAFTERS:
        return min(drafter.max_gamma, drafter.tree_tokens - 1)
    return drafter.max_gamma


def shadow_verifiers(cfg: Any) -> dict[str, Any]:
    """label -> Verifier for each name in ``cfg.shadow``; settings (theta, ...) come from cfg.verifier."""
    shadows = {}
    for name in cfg.shadow:
        if name not in VERIFIER_PARAMS:
            raise ValueError(f"shadow verifier {name!r} is unknown: allowed are {', '.join(VERIFIER_PARAMS)}")
        params = {key: getattr(cfg.verifier, key) for key in VERIFIER_PARAMS[name]}
        label = name + ("(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")
        shadows[label] = get_verifier(name, **params)
    return shadows


def check_run_config(cfg: Any) -> None:
    """Check every range and name before any model is loaded (ValueError, one line)."""
    SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k)
    DecodeSettings(cfg.max_new_tokens, cfg.drafter.gamma)
    get_verifier(cfg.verifier.name, **verifier_params(cfg.verifier))
    shadow_verifiers(cfg)
    check_drafter_name(cfg.drafter.name)
    draft_length_policy(cfg.drafter.length, cfg.drafter.gamma, cfg.drafter.max_gamma)
    if cfg.drafter.name in TREE_DRAFTERS:
        TreeShape(cfg.drafter.gamma, cfg.drafter.top_k, cfg.drafter.tree_tokens)
    if cfg.drafter.name == "eagle3" and not cfg.model.eagle3_head:
        raise ValueError(f"drafter=eagle3 needs model.eagle3_head (a folder or Hub id): model={cfg.model.name} sets none")
    if cfg.drafter.length == "confidence":
        check_min_confidence(cfg.drafter.min_confidence)
    parse_dtype(cfg.model.dtype)
    check_memory_budget(cfg.model.device_map, cfg.model.max_memory)
    if cfg.drafter.name in SEPARATE_MODEL_DRAFTERS and not cfg.model.draft_model:
        raise ValueError(
            f"drafter={cfg.drafter.name} needs model.draft_model, which model={cfg.model.name} does not set: "
            "use drafter=layerskip or lookup"
        )
    if cfg.task.num_prompts is not None and cfg.task.num_prompts < 1:
        raise ValueError(f"task.num_prompts={cfg.task.num_prompts} is invalid: allowed is an integer >= 1 or null (all)")
    from mars_bench.tasks import SCORERS

    if cfg.task.scorer is not None and cfg.task.scorer not in (*SCORERS, "judge"):
        raise ValueError(f"task.scorer={cfg.task.scorer!r} is invalid: allowed are {', '.join(sorted(SCORERS))}, judge or null")
    if cfg.task.scorer == "judge" and not cfg.task.judge_model:
        raise ValueError("task.scorer=judge needs task.judge_model=<Hub id or folder of the judge model>")
    if cfg.warmup < 0:
        raise ValueError(f"warmup={cfg.warmup} is invalid: allowed is an integer >= 0")
