"""The optional extras of the package (``pip install 'mars-bench[EXTRA]'``): what each provides, and
the one line a user gets who asks for it while it is not installed, in place of a traceback.

``python -m mars_bench`` and the analysis need none of them. ``lm-eval``: the ``mars-bench-lm-eval``
command and the ``mars_bench`` model of lm-eval (``mars_bench.lm_eval_model``). ``launchers``: Hydra's
joblib launcher (``hydra/launcher=joblib``, cells at once on one machine) and submitit launcher
(``hydra/launcher=slurm``, ``submitit_local``). ``test`` installs both. pyproject.toml pins them.
"""

from __future__ import annotations

import importlib.util
import sys

JOBLIB = "hydra_plugins.hydra_joblib_launcher"
SUBMITIT = "hydra_plugins.hydra_submitit_launcher"
LAUNCHERS = {"joblib": JOBLIB, "slurm": SUBMITIT, "submitit_slurm": SUBMITIT, "submitit_local": SUBMITIT}  # option -> plugin


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module that failed to import before
        return False


def needs(extra: str, what: str) -> str:
    """The line that names the extra to install: ``hydra/launcher=slurm needs the launchers extra: ...``."""
    return f"{what} needs the {extra} extra, which is not installed: pip install 'mars-bench[{extra}]'"


def check_launcher(overrides: list[str]) -> None:
    """Refuse, in one line naming the extra, a ``hydra/launcher=...`` whose Hydra plugin is not installed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except HydraException:
        return  # Hydra itself reports a malformed override
    for override in parsed:
        if override.key_or_group == "hydra/launcher" and not override.is_sweep_override():
            plugin = LAUNCHERS.get(str(override.value()))
            if plugin is not None and not installed(plugin):
                raise ValueError(needs("launchers", f"hydra/launcher={override.value()}"))


def lm_eval_cli() -> None:
    """The ``mars-bench-lm-eval`` command: lm-eval's command line with the ``mars_bench`` model, or one
    line naming the extra (exit status 2) where lm-eval is not installed."""
    if not installed("lm_eval"):
        print(f"mars-bench-lm-eval: error: {needs('lm-eval', 'mars-bench-lm-eval')}", file=sys.stderr)
        raise SystemExit(2)
    from mars_bench.lm_eval_model import cli

    cli()
