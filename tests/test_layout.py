"""The package layout: imports point one way, and no file name shadows a package.

The graph is between top-level packages, read with `ast` from every import in their files (not
by importing them). An import inside a function counts too: a lazy import still ties the two
packages together. The only exception is the `pdserve` command line's dispatch functions, which
hand one subcommand's argv to the package that owns it, and import it only when that runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "engine",
    "kv_transfer",
    "prefill_worker",
    "decode_worker",
    "worker",
    "router",
    "deploy",
    "planner",
    "benchmarks",
)
# (file, function) pairs whose imports do not count: `pdserve bench|plan|profile` forwarding.
DISPATCH = {
    ("deploy/cli/main.py", "_run_bench"),
    ("deploy/cli/main.py", "_run_plan"),
    ("deploy/cli/main.py", "_run_profile"),
}


def _imported_packages(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return set()
    return {name.split(".")[0] for name in names} & set(PACKAGES)


def _imports(path: Path) -> set[str]:
    """Top-level packages that `path` imports, outside the DISPATCH functions."""
    relative = path.relative_to(REPO).as_posix()
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if (relative, node.name) in DISPATCH:
                return
        found.update(_imported_packages(node))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=relative))
    return found


def import_graph(root: Path = REPO) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {package: set() for package in PACKAGES}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            graph[package] |= _imports(path) - {package}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_package_graph_has_no_cycle() -> None:
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_only_benchmarks_imports_benchmarks() -> None:
    importers = {name for name, deps in import_graph().items() if "benchmarks" in deps}
    assert importers == set(), f"{sorted(importers)} import benchmarks (it sits on top)"


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_named_like_a_top_level_package() -> None:
    """`python path/to/x.py` puts x's folder first on sys.path: a benchmarks/engine.py there
    would be imported as `engine`. (tests/ mirrors the packages as folders, by design.)"""
    top_level = {*PACKAGES, "proto", "pdserve_proto", "tests"}
    shadows = [
        path.relative_to(REPO).as_posix()
        for package in (*PACKAGES, "proto", "tests")
        for path in (REPO / package).rglob("*.py")
        if path.stem in top_level
    ]
    assert shadows == []
