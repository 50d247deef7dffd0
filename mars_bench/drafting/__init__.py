"""Drafters: propose chains or trees of tokens with their draft probabilities."""

from mars_bench.drafting import eagle3, layerskip, lookup, model  # noqa: F401  (registration)
from mars_bench.drafting.base import Draft, Drafter, available_drafters, build_drafter, check_drafter_name, drafter_for

__all__ = ["Draft", "Drafter", "available_drafters", "build_drafter", "check_drafter_name", "drafter_for"]
