"""The method a config names: its drafter, draft length, verifier and sampling as one ``MethodSpec``, and the
shadow verifiers judged beside it."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from mars_bench.common.settings import parse_label, values_label
from mars_bench.decoding.draft_length import DraftLengthSettings
from mars_bench.drafting import drafter_settings
from mars_bench.method import MethodSpec
from mars_bench.verification import (
    WINDOW,
    available_verifiers,
    get_verifier,
    verifier_from_settings,
    verifier_settings,
    with_exact_first,
)
from mars_bench.verification.sampling import SamplingParams


def plugin_settings(settings_class: type, config: Any) -> dict[str, Any]:
    """The values of ``settings_class``'s fields that a config node (a drafter's or verifier's) has."""
    return {item.name: getattr(config, item.name) for item in fields(settings_class) if item.name in config}


def verifier_params(verifier: Any) -> dict[str, Any]:
    """The settings the named verifier takes, from the ``verifier`` config node, and its window (``WINDOW``)."""
    return {**plugin_settings(verifier_settings(verifier.name), verifier), WINDOW: verifier.get(WINDOW, 0)}


def drafter_params(drafter: Any) -> dict[str, Any]:
    """The settings the named drafter takes, from the ``drafter`` config node."""
    return plugin_settings(drafter_settings(drafter.name), drafter)


def method_spec(cfg: Any) -> MethodSpec:
    """The configured method: the ``drafter`` node (name, draft length, the drafter's own settings), the
    ``verifier`` node and the sampling keys, checked (ValueError, one line)."""
    drafter = cfg.drafter
    settings = drafter_params(drafter)
    return MethodSpec.create(
        drafter.name,
        cfg.verifier.name,
        drafter_settings=settings,
        verifier_settings=verifier_params(cfg.verifier),
        length=DraftLengthSettings(drafter.length, drafter.gamma, drafter.max_gamma, drafter.min_confidence, drafter.draft_cost),
        sampling=SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k),
    )


def configured_spec(cfg: Any) -> MethodSpec | None:
    """The configured method (``method_spec``), or None where the config cannot build one (the cell's check refuses
    it, in its own line; a failure row then carries no method settings)."""
    try:
        return method_spec(cfg)
    except (TypeError, ValueError):
        return None


def shadow_verifiers(cfg: Any) -> dict[str, Any]:
    """label -> Verifier for each entry of ``cfg.shadow``: a name (``mars``) takes the settings that
    the live verifier shares with it (its own, for a shadow of the live verifier; ``theta`` of a live
    ``mars_ref`` for a ``mars`` shadow) and, a lossy rule, the live verifier's ``exact_first`` window, the rest at
    its defaults; a spec with settings (``mars(theta=0.8)``, ``tv_budget(eps=0.05)``, ``mars(exact_first=16)``)
    sets those and leaves the rest at the verifier's defaults.

    The label is the name with its settings: ``mars(theta=0.9,guard=never,correction=residual)``."""
    shadows = {}
    for spec in cfg.shadow:
        name, settings = parse_label(str(spec))
        if name not in available_verifiers():
            raise ValueError(f"shadow verifier {name!r} is unknown: allowed are {', '.join(available_verifiers())}")
        try:
            if settings:
                verifier = verifier_from_settings(name, settings)
            else:
                rule = get_verifier(name, **plugin_settings(verifier_settings(name), cfg.verifier))
                verifier = rule if rule.lossless else with_exact_first(rule, cfg.verifier.get(WINDOW, 0))
        except (TypeError, ValueError) as error:
            raise ValueError(f"shadow {spec!r}: {error}") from None
        label = values_label(name, {key: value for key, value in verifier.describe().items() if key != "name"})
        if label in shadows:
            raise ValueError(f"shadow {spec!r} repeats {label}: each shadow verifier must differ")
        shadows[label] = verifier
    return shadows
