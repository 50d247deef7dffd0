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


def cli_value(value: object) -> str:
    """A setting's value as a command line writes it (true/false for booleans, null for None)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


OPTIONAL = {"omit_when_default": True}  # field metadata: a setting added later, left out of labels at its default


def label_values(settings: Any) -> dict[str, Any]:
    """A settings dataclass's values as labels carry them: every field, except an ``OPTIONAL`` one at
    its default, so that records made before the option existed keep their labels."""
    return label_items(type(settings), {item.name: getattr(settings, item.name) for item in dataclasses.fields(settings)})


def label_items(settings_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (one per field of ``settings_class``, not yet checked) as labels carry them (see ``label_values``)."""
    return {
        item.name: values[item.name]
        for item in dataclasses.fields(settings_class)
        if not (item.metadata.get("omit_when_default") and values[item.name] == item.default)
    }


def plugin_label(name: str, settings: Any) -> str:
    """``name(key=value,...)``, or the bare name for a plugin without settings: how records name a
    shadow verifier and the fidelity of each verifier."""
    return values_label(name, label_values(settings))


def values_label(name: str, values: dict[str, Any]) -> str:
    """``name(key=value,...)`` from the values labels carry (``label_values``), or the bare name without any."""
    return name + (f"({setting_string(values)})" if values else "")


def parse_value(text: str) -> Any:
    """A setting's value written in a label or a shadow spec: None/null, an int, a float, else the text."""
    text = text.strip()
    if text in ("None", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_setting(text: str, within: str | None = None) -> dict[str, Any]:
    """``theta=0.8,guard=gap`` -> {"theta": 0.8, "guard": "gap"}: the pairs ``setting_string`` writes, each value
    read by ``parse_value``; empty text has no settings. ValueError, in one line, on a pair that is not
    key=value (naming ``within``, the plugin label the text is part of, where there is one)."""
    values: dict[str, Any] = {}
    for pair in filter(None, text.split(",")):
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            where = f"{within!r} is not a plugin label" if within else f"setting {text!r} is malformed"
            raise ValueError(f"{where}: {pair!r} is not key=value")
        values[key.strip()] = parse_value(value)
    return values


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """``mars(theta=0.8,guard=gap)`` -> ("mars", {"theta": 0.8, "guard": "gap"}); a bare name has no settings.
    The inverse of ``plugin_label``; ValueError, in one line, on a malformed label."""
    name, bracket, rest = label.strip().partition("(")
    if not bracket:
        return name, {}
    if not rest.endswith(")") or not name:
        raise ValueError(f"{label!r} is not a plugin label: allowed is name or name(key=value,...)")
    return name.strip(), parse_setting(rest[:-1], within=label)
