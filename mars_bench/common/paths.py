"""Where the harness finds its Hydra configs, in a checkout and in an installed wheel.

A wheel carries ``conf/`` inside the package (``mars_bench/conf``); a checkout, and an editable
install of it, keep ``conf/`` beside the package at the repository's top level, where users see it.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # mars_bench/


def _conf_dir() -> Path:
    inside = PACKAGE_DIR / "conf"
    return inside if (inside / "config.yaml").is_file() else PACKAGE_DIR.parent / "conf"


CONF_DIR = _conf_dir()
