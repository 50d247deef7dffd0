"""The run manifest: what ran, where, with which versions, weights and seeds."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from mars_bench.bench.contention import ContentionMeter, machine_load
from mars_bench.bench.records import MANIFEST_FILE
from mars_bench.common.cpu import BF16_FLAGS, cpu_info, cpu_kind
from mars_bench.common.kernels import DEFAULT_KERNELS
from mars_bench.common.paths import CONF_DIR, PACKAGE_DIR
from mars_bench.models.placement import drafter_device, input_device, placement

REPO_ROOT = PACKAGE_DIR.parent

PACKAGES = ("mars-bench", "torch", "transformers", "accelerate", "hydra-core", "safetensors", "gguf", "datasets", "numpy")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirty flag of the repository the package runs from (None outside git)."""

    def git(*args: str) -> str | None:
        try:
            result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def cpu_description() -> dict[str, Any]:
    """The CPU a run measured on: model, cores, its native-bf16 flags (``native_bf16``: any of
    ``BF16_FLAGS``; None where /proc/cpuinfo cannot be read), its kind (``common/cpu.py``) and torch's threads."""
    model, flags = cpu_info()
    native = {flag: None if flags is None else flag in flags for flag in BF16_FLAGS}
    return {
        "model": model,
        "cores": os.cpu_count(),
        **native,
        "native_bf16": None if flags is None else any(native.values()),
        "kind": cpu_kind(flags),
        "torch_threads": torch.get_num_threads(),
    }


def emulated_bf16_warning(dtype: str | None, device_map: str | None, cpu: dict[str, Any] | None = None,
                          kernels: str = DEFAULT_KERNELS) -> str | None:
    """The warning, one line without the program's prefix, where a model would run bf16 matrix products the CPU
    emulates: ``dtype`` bfloat16, placed on the CPU (``device_map`` None or ``cpu``), and a CPU with none of
    ``BF16_FLAGS``; it says what ``kernels`` (``model.kernels``) does about it. None otherwise, and where the
    flags cannot be read. What it says was measured on an AVX2-only CPU (docs/performance.md#a-cpu-without-native-bf16):
    each row of a stock bf16 product costs about what a one-row product costs, and a float32 copy of the weights
    takes the wide ones (``cpu_linear.widened_forward``); the results stay valid, they are that CPU's."""
    if dtype != "bfloat16" or device_map not in (None, "cpu"):
        return None
    cpu = cpu_description() if cpu is None else cpu
    if cpu.get("native_bf16") is not False:
        return None
    machine = f"dtype=bfloat16 on a CPU without native bf16 ({cpu.get('model')}: none of {', '.join(BF16_FLAGS)}): "
    if kernels == "stock":
        return machine + (
            "its bf16 products are emulated and model.kernels=stock leaves them so: each token of a many-token forward "
            "(a prompt, a long draft's verification) costs about what a one-token forward costs; model.kernels=auto "
            "takes those through float32 copies of the weights (docs/performance.md#a-cpu-without-native-bf16)"
        )
    return machine + (
        f"its bf16 products are emulated, so model.kernels={kernels} keeps one-token forwards in bf16 and takes wider "
        "ones (a prompt, a verification) through float32 copies of the linear weights where memory allows (twice the "
        "weights' size; the manifest's packed_linears says what was packed); the speedups "
        "measured here are this CPU's (docs/performance.md#a-cpu-without-native-bf16)"
    )


def gpu_description() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    return [
        {"name": torch.cuda.get_device_name(i), "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
        for i in range(torch.cuda.device_count())
    ]


def model_record(role: str, loaded: Any, models: dict[str, Any]) -> dict[str, Any]:
    """One model's manifest entry: dtype, placement, the max_memory it was planned against and
    the plan's sizes (sharded loads), the kernels asked for and what was packed at load (layers, the
    seconds it took, outside every timed row, and the packed copies' size), and for a drafter beside a
    target the placement rule."""
    record: dict[str, Any] = {
        "dtype": loaded.dtype,
        "placement": placement(loaded.model),
        "max_memory": {str(k): v for k, v in loaded.max_memory.items()} if getattr(loaded, "max_memory", None) else None,
        "plan": loaded.plan.to_record() if getattr(loaded, "plan", None) is not None else None,
        "kernels": getattr(loaded, "kernels", None),
        "packed_linears": loaded.packed.describe() if getattr(loaded, "packed", None) is not None else None,
    }
    if role == "drafter" and "target" in models:
        record["placed_with"] = {
            "rule": "the target's input-embedding device (its first device)",
            "device": str(input_device(loaded.model)),
            "target_input_device": str(drafter_device(models["target"].model)),
        }
    return {**record, **loaded.resolved.to_record()}


def source_hash(package: Path = PACKAGE_DIR, conf: Path = CONF_DIR) -> str:
    """sha256 over the harness's own code and configs (``*.py``, ``*.yaml`` of the package and of ``conf/``).

    Names the code where git cannot: a run from an exported tree (``git archive``) or from an
    installed wheel. Each file is named as it stands in a checkout (``mars_bench/...``,
    ``conf/...``; the analysis, which runs no model, is left out), so a checkout and a wheel
    built from it hash alike. Taken when the manifest is written.
    """
    inside = {package / "conf", package / "analysis"}  # where a wheel carries conf/ and analysis/
    code = [p for p in package.rglob("*") if not any(folder in p.parents for folder in inside)]
    named = [(f"mars_bench/{p.relative_to(package).as_posix()}", p) for p in code]
    named += [(f"conf/{p.relative_to(conf).as_posix()}", p) for p in conf.rglob("*")]
    digest = hashlib.sha256()
    for name, path in sorted((name, path) for name, path in named if path.suffix in (".py", ".yaml")):
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def text_hash(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


def build_manifest(
    config: dict[str, Any],
    models: dict[str, Any],
    seeds: dict[str, Any],
    methods: dict[str, Any] | None = None,
    questions: dict[str, Any] | None = None,
    load: ContentionMeter | None = None,
) -> dict[str, Any]:
    """``models``: role -> LoadedModel. ``methods``: label -> the drafter's and verifier's settings.
    ``questions``: where the task's questions came from (a file, a Hub dataset or a pinned package;
    ``tasks.providers.QuestionSet.source``). ``load``: a meter started when the run began, read for the machine's
    load (``machine_load``; None: half a second is sampled now)."""
    load_record = machine_load(load)  # first: the git processes below are this run's, but once ended no longer counted as its own
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "git": git_state(),
        "source_sha256": source_hash(),
        "cpu": cpu_description(),
        "gpu": gpu_description(),
        "machine_load": load_record,
        "models": {role: model_record(role, loaded, models) for role, loaded in models.items()},
        "methods": methods or {},
        "questions": questions,
        "seeds": seeds,
        "system_prompt_sha256": text_hash(config.get("task", {}).get("system_prompt")),
        "config": config,
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """manifest.json for the first session in a folder, manifest.resumed-N.json after."""
    path = folder / MANIFEST_FILE
    resumed = 1
    while path.exists():
        path = folder / f"manifest.resumed-{resumed}.json"
        resumed += 1
    path.write_text(json.dumps(manifest, indent=1, default=str))
    return path
