"""The imports of ``bench``, ``deploy``, ``rampart`` and ``tests`` (a guard on the repository, no one module): no
import circle among ``bench/``, ``deploy/`` and ``rampart/`` (every ``import`` statement counts, also those inside
functions), and no test module imports another test module
(shared helpers live in the ``tests.support`` package and ``tests/unit/standins.py``; docs/testing.md, "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("bench", "deploy", "rampart")


def module_name(path: Path, root: Path = ROOT) -> str:
    """``root/bench/harness.py`` → ``bench.harness``; ``root/rampart/api/__init__.py`` → ``rampart.api``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The modules in ``known`` that ``path`` imports anywhere in its body (module level, functions, classes):
    ``import a.b`` names ``a.b``; ``from a import b`` names ``a.b`` when that is a module, else ``a``;
    relative imports are resolved against ``path``'s package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root).split(".")
    package = name if path.name == "__init__.py" else name[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[:len(package) - node.level + 1]
                base = ".".join([*prefix, base] if base else prefix)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out & known


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module of ``packages`` under ``root`` (edges only between them)."""
    files = {module_name(path, root): path for package in packages for path in (root / package).rglob("*.py")}
    known = set(files)
    return {name: imported_modules(path, known, root) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle per strongly connected component of more than one module (Tarjan), each as
    a path ``[a, b, …, a]``; empty when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [circle(graph, set(component)) for component in components]


def circle(graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A path through ``members`` (one strongly connected component) from its first module back to it."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                frontier.append(nxt)
    raise AssertionError(f"{sorted(members)} is not strongly connected")


def test_the_checker_finds_a_circle_made_by_a_function_level_or_relative_import(tmp_path):
    """The checker itself, on a small tree: the circle the benchmarks once had (the composing module imports a
    scenario, which imports it back inside a function) is found, and so is one through a relative import;
    without them there is none."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "harness.py").write_text("import os\n")
    (bench / "load_bench.py").write_text("from bench.ceiling import scenario\nfrom bench import harness\n")
    (bench / "ceiling.py").write_text("from bench.harness import free_port\n")
    assert cycles(import_graph(tmp_path, ("bench",))) == []
    (bench / "ceiling.py").write_text("def scenario():\n    from bench.load_bench import Service\n")
    assert cycles(import_graph(tmp_path, ("bench",))) == [["bench.ceiling", "bench.load_bench", "bench.ceiling"]]
    (bench / "ceiling.py").write_text("")
    (bench / "harness.py").write_text("from . import load_bench\n")
    assert cycles(import_graph(tmp_path, ("bench",))) == [["bench.harness", "bench.load_bench", "bench.harness"]]


def test_no_import_circle_in_bench_deploy_and_rampart():
    graph = import_graph()
    assert {"bench.harness", "bench.load_bench", "deploy.cluster", "rampart.pipeline"} <= set(graph)
    assert "bench.harness" in graph["deploy.cluster"] and "bench.harness" in graph["bench.ceiling"]
    assert cycles(graph) == []


def test_no_test_module_imports_another_test_module():
    """Every import under tests/ of a ``test_*`` module (``tests.unit.test_app``, ``from tests.server import
    test_observability``, ...) is listed; there must be none."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(f"{node.module or ''}.{alias.name}" for alias in node.names)]
            else:
                continue
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
