"""A plugin's settings: one frozen dataclass per verifier or drafter (torch-free).

The registries of ``verification`` and ``drafting`` check the class a plugin registers with and
build its settings from keys by name here; records carry them as ``key=value`` pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def check_settings_class(kind: str, name: str, settings: type) -> type:
    """``settings`` must be a frozen dataclass (its fields are the plugin's settings); TypeError otherwise."""
    if not dataclasses.is_dataclass(settings) or not settings.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"settings of {kind} {name} must be a frozen dataclass, got {settings!r}")
    return settings


def settings_from(kind: str, name: str, settings: type, values: dict[str, Any]) -> Any:
    """``settings(**values)``, unset fields at their defaults; a key that is not a field is refused in
    one line naming the allowed ones: ``verifier mars has no setting 'thet': allowed are theta, ...``."""
    allowed = [field.name for field in dataclasses.fields(settings)]
    unknown = [key for key in values if key not in allowed]
    if unknown:
        keys = ", ".join(repr(key) for key in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise ValueError(f"{kind} {name} has no setting{plural} {keys}: allowed are {', '.join(allowed) or 'none'}")
    return settings(**values)


def setting_string(values: dict[str, Any]) -> str:
    """``key=value`` pairs joined by commas, as records carry a plugin's setting: ``theta=0.9,guard=never``."""
    return ",".join(f"{key}={value}" for key, value in values.items())
