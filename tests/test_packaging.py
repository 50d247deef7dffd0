"""The wheel's package list: every package of the checkout, with analysis/ and conf/ inside mars_bench; the
extras; and the test extra's pins keeping the suite's xdist groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_lists_every_package_of_the_checkout():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {*find_packages(REPO, include=["mars_bench*"]), *(f"mars_bench.{name}" for name in find_packages(REPO / "analysis"))}
    assert found | {"mars_bench.analysis", "mars_bench.conf"} == listed
    assert setuptools["package-dir"] == {"mars_bench.analysis": "analysis", "mars_bench.conf": "conf"}


def core_closure(pyproject: dict) -> set[str]:
    """The distributions the core dependencies install (no extras), read from the installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    names, todo = set(), [Requirement(line) for line in pyproject["project"]["dependencies"]]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in names or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        names.add(name)
        todo += [Requirement(line) for line in metadata.requires(requirement.name) or []]
    return names


def imported_modules(files: list[Path]) -> set[str]:
    """The top-level modules that ``files`` import anywhere (function bodies included), less relative imports."""
    import ast

    modules = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules.add(node.module.split(".")[0])
    return modules


EXTRA_MODULES = {  # modules that only an extra's feature imports, or that run in vLLM's own environment (serving/install.py)
    "mars_bench/lm_eval_model.py": "lm-eval",
    "mars_bench/serving/vllm_plugin.py": "vllm",
    "mars_bench/serving/vllm_worker.py": "vllm",
}


def test_everything_the_app_and_the_analysis_import_comes_with_the_core_dependencies():
    import sys
    from importlib import metadata

    from packaging.utils import canonicalize_name

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    files = [p for p in [*(REPO / "mars_bench").rglob("*.py"), *(REPO / "analysis").rglob("*.py")]
             if p.relative_to(REPO).as_posix() not in EXTRA_MODULES]  # fmt: skip
    third_party = imported_modules(files) - set(sys.stdlib_module_names) - {"mars_bench", "analysis", "__future__"}
    owners = metadata.packages_distributions()
    closure = core_closure(pyproject)
    missing = {module: owners.get(module) for module in third_party
               if not {canonicalize_name(name) for name in owners.get(module, [])} & closure}  # fmt: skip
    assert not missing, f"imported but installed only by an extra (or not at all): {missing}"
    for extra in ("lm-eval", "launchers"):  # what the extras add is not core
        for line in pyproject["project"]["optional-dependencies"][extra]:
            assert canonicalize_name(line.split("==")[0]) not in closure, line


def test_the_test_extra_installs_every_other_extra():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (itself,) = [line for line in extras["test"] if line.startswith("mars-bench[")]
    assert set(itself.removeprefix("mars-bench[").removesuffix("]").split(",")) == set(extras) - {"test"}


def test_a_launcher_or_command_whose_extra_is_missing_is_refused_in_one_line(monkeypatch, capsys):
    from conftest import python_m

    from mars_bench.common import extras

    extras.check_launcher(["-m", "hydra/launcher=slurm", "hydra/launcher=joblib"])  # installed here: no error
    monkeypatch.setattr(extras, "installed", lambda module: False)
    with pytest.raises(ValueError, match=r"^hydra/launcher=slurm needs the launchers extra, which is not installed: "
                                         r"pip install 'mars-bench\[launchers\]'$"):  # fmt: skip
        extras.check_launcher(["-m", "hydra/launcher=slurm", "model=qwen3-8b"])
    extras.check_launcher(["hydra/launcher=basic"])  # Hydra's own
    result = python_m("mars_bench", "-m", "hydra/launcher=joblib", "experiment=smoke")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "mars_bench: error: hydra/launcher=joblib needs the launchers extra, which is not installed: "
        "pip install 'mars-bench[launchers]'"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        extras.lm_eval_cli()
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "mars-bench-lm-eval: error: mars-bench-lm-eval needs the lm-eval extra, which is not installed: "
        "pip install 'mars-bench[lm-eval]'"]  # fmt: skip


@pytest.fixture(scope="module")
def module_fixture() -> str:
    return "shared"


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="one process (-n 0): no xdist workers, so no groups to keep")
def test_tests_sharing_a_module_fixture_run_on_one_xdist_worker(module_fixture, request):
    # conftest marks the test with its module's group; xdist keeps a group on one worker only where the
    # group shows in the node id (pytest 9.2 and xdist 3.8 lose it, and every worker set the fixture up).
    assert request.node.nodeid.endswith(f"@{request.node.module.__name__}"), request.node.nodeid
