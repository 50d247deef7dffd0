"""The wheel's package list: every package of the checkout, with analysis/ and conf/ inside mars_bench."""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_lists_every_package_of_the_checkout():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {*find_packages(REPO, include=["mars_bench*"]), *(f"mars_bench.{name}" for name in find_packages(REPO / "analysis"))}
    assert found | {"mars_bench.analysis", "mars_bench.conf"} == listed
    assert setuptools["package-dir"] == {"mars_bench.analysis": "analysis", "mars_bench.conf": "conf"}
