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

PACKAGES = ("mars-bench", "torch", "transformers", "accelerate", "hydra-core", "safetensors", "gguf", "datasets", "numpy")
REPO_ROOT = Path(__file__).resolve().parents[2]


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
    model, flags = None, ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line
    except OSError:
        model = platform.processor() or None
    return {
        "model": model,
        "cores": os.cpu_count(),
        "avx512_bf16": "avx512_bf16" in flags,
        "torch_threads": torch.get_num_threads(),
    }


def gpu_description() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    return [
        {"name": torch.cuda.get_device_name(i), "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
        for i in range(torch.cuda.device_count())
    ]


def placement(model: Any) -> Any:
    """device_map placement when sharded, else the single device."""
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        return {name: str(device) for name, device in device_map.items()}
    return str(model.get_input_embeddings().weight.device)


def text_hash(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]


def build_manifest(config: dict[str, Any], models: dict[str, Any], seeds: dict[str, Any]) -> dict[str, Any]:
    """``models``: role -> LoadedModel."""
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "git": git_state(),
        "cpu": cpu_description(),
        "gpu": gpu_description(),
        "models": {
            role: {"dtype": loaded.dtype, "placement": placement(loaded.model), **loaded.resolved.to_record()}
            for role, loaded in models.items()
        },
        "seeds": seeds,
        "system_prompt_sha256": text_hash(config.get("task", {}).get("system_prompt")),
        "config": config,
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    """manifest.json for the first session in a folder, manifest.resumed-N.json after."""
    path = folder / "manifest.json"
    resumed = 1
    while path.exists():
        path = folder / f"manifest.resumed-{resumed}.json"
        resumed += 1
    path.write_text(json.dumps(manifest, indent=1, default=str))
    return path
