"""The package's import graph has no cycle: every module of ``mars_bench`` (and of ``analysis``, which a wheel
installs as ``mars_bench.analysis``) imports only modules that do not import it back, directly or through
others. Every import counts, at the top of a module or inside a function (a lazy import hides a cycle, it
does not remove it); a package's ``__init__`` counts as a module of its own, and importing a module runs the
``__init__`` of every package above it first (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``), so an
import is also an edge to each of those packages that the importing module is not itself inside."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("mars_bench", "analysis")


def module_files(repo: Path = REPO) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``ROOTS`` of ``repo`` (the committed examples are data)."""
    modules = {}
    for root in ROOTS:
        for path in (repo / root).rglob("*.py"):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if "examples" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that module ``name`` imports: for ``from A import B``, the module ``A.B`` where
    that is a module, else ``A`` (or the nearest enclosing module of ours)."""

    def ours(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {ours(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else ours(base))
    found |= {parent for module in found if module for parent in packages_run_first(module, package, modules)}
    return {module for module in found if module and module != name}


def packages_run_first(module: str, package: str, modules: dict[str, Path]) -> set[str]:
    """The packages whose ``__init__`` importing ``module`` runs first, from inside ``package``: those above it
    that ``package`` is not itself inside (those are running already)."""
    parts = module.split(".")
    above = {".".join(parts[:end]) for end in range(1, len(parts))}
    own = {".".join(package.split(".")[:end]) for end in range(1, len(package.split(".")) + 1)}
    return {parent for parent in above - own if parent in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    modules = module_files(repo)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 100  # every module was read
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    graph = import_graph()
    graph["mars_bench.common.files"] = {*graph["mars_bench.common.files"], "mars_bench.bench.cell"}  # a cycle made up
    (cycle,) = cycles(graph)
    assert {"mars_bench.common.files", "mars_bench.bench.cell"} <= set(cycle)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_relative_and_from_imports_resolve_to_our_modules():
    modules = module_files()
    assert "mars_bench.verification.base" in imported("mars_bench.verification", modules["mars_bench.verification"], modules)
    assert "mars_bench.bench.run_folder" in imported("mars_bench.__main__", modules["mars_bench.__main__"], modules)


@pytest.mark.slow
def test_a_cycle_through_a_packages_init_is_caught(tmp_path):
    """Planted in a copy: ``drafting/lookup.py`` importing ``mars_bench.decoding.engine`` runs ``decoding/__init__``,
    which imports the engine, which imports the drafters: ``import mars_bench.decoding`` then fails, and the graph
    has the cycle through the package's ``__init__``."""
    copy = tmp_path / "repo"
    for root in ROOTS:
        shutil.copytree(REPO / root, copy / root, ignore=shutil.ignore_patterns("__pycache__", "examples"))
    assert cycles(import_graph(copy)) == []
    lookup = copy / "mars_bench" / "drafting" / "lookup.py"
    planted = "import torch\n\nfrom mars_bench.decoding.engine import cut_at_stop  # noqa: F401\n"
    lookup.write_text(lookup.read_text().replace("import torch\n", planted, 1))
    found = cycles(import_graph(copy))
    assert any({"mars_bench.decoding", "mars_bench.drafting.lookup"} <= set(cycle) for cycle in found), found
    broken = subprocess.run([sys.executable, "-c", "import mars_bench.decoding"], cwd=copy, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(copy)}, timeout=120)  # fmt: skip
    assert broken.returncode != 0 and "ImportError" in broken.stderr  # the cycle is real: the package cannot load
