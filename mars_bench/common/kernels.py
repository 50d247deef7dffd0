"""``model.kernels``: how the engine's linear layers compute on the CPU (``mars_bench/models/cpu_linear.py``).

Torch-free, so that configs and records can name the values without loading a model."""

from __future__ import annotations

KERNELS = ("auto", "onednn", "stock")  # auto: what cpu_linear.auto_dtypes names for this CPU, the rest stock
DEFAULT_KERNELS = "auto"
EARLIER_KERNELS = "stock"  # what every row and config older than model.kernels ran


def check_kernels(kernels: str) -> None:
    """ValueError in one line unless ``kernels`` is one of ``KERNELS``."""
    if kernels not in KERNELS:
        raise ValueError(f"model.kernels={kernels!r} is unknown: allowed are {', '.join(KERNELS)}")
