"""Drafters: propose chains or trees of tokens with their draft probabilities, for every row of a batch
(one sequence is a batch of one: ``Drafter``; a drafter written for one sequence: ``SequenceDrafter``).

Each drafter registers its factory and its settings dataclass (``drafting/base.py``); the
registry answers what a drafter takes and needs: ``drafter_settings``, ``drafter_needs_model``,
``is_tree_drafter``, ``drafters_with_stops``.
"""

from mars_bench.drafting import eagle3, layerskip, lookup, model  # noqa: F401  (registration)
from mars_bench.drafting.base import (
    Draft,
    Drafter,
    DrafterContext,
    NoSettings,
    SequenceDrafter,
    available_drafters,
    build_drafter,
    build_settings,
    check_drafter_name,
    drafter_for,
    drafter_needs_model,
    drafter_settings,
    drafters_with_stops,
    drafters_without_model,
    is_tree_drafter,
    register_drafter,
)

__all__ = [
    "Draft",
    "Drafter",
    "DrafterContext",
    "NoSettings",
    "SequenceDrafter",
    "available_drafters",
    "build_drafter",
    "build_settings",
    "check_drafter_name",
    "drafter_for",
    "drafter_needs_model",
    "drafter_settings",
    "drafters_with_stops",
    "drafters_without_model",
    "is_tree_drafter",
    "register_drafter",
]
