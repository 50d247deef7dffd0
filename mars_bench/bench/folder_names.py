"""Sweep folder names that carry the verifier's settings, whichever verifier it is.

``hydra.sweep.subdir`` (conf/config.yaml) names each cell of a sweep with ``${verifier_label:}``: the
verifier's name, then each of its own settings that the job's overrides set, as ``<key><value>``, in the
order the verifier declares them. ``-m verifier.KEY=0.8,0.9`` gives cells ``0_humaneval_<name>_KEY0.8_t1.0``
and ``1_humaneval_<name>_KEY0.9_t1.0``; a verifier at its configured settings keeps its bare name; a key
that the named verifier does not take (a sweep over several verifiers) is left out of its cells' names.
The job number in front keeps every cell of a sweep apart.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from omegaconf import OmegaConf

RESOLVER = "verifier_label"  # the name conf/config.yaml calls it by
GROUP = "verifier"  # the config node of the verifier, and the prefix of its overrides
UNSAFE = re.compile(r"[^\w.+-]")  # characters a folder name should not carry (path separators, spaces, quotes)


def overridden_keys(overrides: list[str], group: str = GROUP) -> set[str]:
    """The keys of ``group`` that ``overrides`` (Hydra's, as ``hydra.overrides.task`` lists them) set:
    ``verifier.KEY=0.8`` and ``+verifier.KEY=0.8`` give ``KEY``; deletions and other groups, nothing."""
    keys = set()
    for override in overrides:
        if override.startswith("~"):
            continue
        key = override.lstrip("+").split("=", 1)[0]
        prefix, dot, rest = key.partition(".")
        if prefix == group and dot and "." not in rest:
            keys.add(rest)
    return keys


def shown_value(value: Any) -> str:
    """A setting's value as a folder name carries it: as the config prints it (``0.8``, ``None``, ``gap``),
    any character unsafe in a file name replaced by ``-``."""
    return UNSAFE.sub("-", str(value))


def label(name: str, settings: dict[str, Any], overridden: set[str]) -> str:
    """``name`` followed by ``_<key><value>`` for each of ``settings`` (the verifier's own, in its order)
    that ``overridden`` names: ``<name>_KEY0.8``."""
    parts = [name, *(f"{key}{shown_value(value)}" for key, value in settings.items() if key in overridden)]
    return "_".join(parts)


def verifier_label(*, _root_: Any) -> str:
    """``${verifier_label:}``: the configured verifier's name with each of its settings that this job's
    overrides set (``label``). The settings are the fields of the verifier's registered settings class, then its
    exact-first window (``verification.WINDOW``)."""
    from mars_bench.verification import WINDOW, verifier_settings

    verifier = _root_[GROUP]
    keys = [*(item.name for item in fields(verifier_settings(verifier.name))), WINDOW]
    settings = {key: verifier[key] for key in keys if key in verifier}
    overrides = OmegaConf.select(_root_, "hydra.overrides.task", default=None) or []
    return label(str(verifier.name), settings, overridden_keys([str(item) for item in overrides]))


def register_folder_names() -> None:
    """Register ``${verifier_label:}`` with OmegaConf (once)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, verifier_label)
