"""Processes doing a run's own work outside its Python process (a backend's engine workers, with whatever
they start): the contention meter (``bench/contention.py``) counts their CPU time as the run's, and every
other process's, the run's own unrelated children included, as another's."""

from __future__ import annotations

_ADOPTED: set[int] = set()


def adopt(pid: int) -> None:
    """Count process ``pid`` and its descendants as this run's own work from now on."""
    _ADOPTED.add(pid)


def release(pid: int) -> None:
    """Stop counting process ``pid`` (it ended or is being stopped)."""
    _ADOPTED.discard(pid)


def adopted() -> frozenset[int]:
    return frozenset(_ADOPTED)
