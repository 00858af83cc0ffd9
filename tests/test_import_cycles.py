"""No two modules of `offload` import each other, directly or around a circle, counting every import
(type-only ones under ``TYPE_CHECKING`` and those inside functions included): the imports are read with
`ast`, nothing is imported. And no module is over 600 lines."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("offload", "tensorio")
MAX_LINES = 600


def _modules(package: str) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package's __init__) for every module of ``package``."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _imported(tree: ast.Module, name: str, is_package: bool, modules: dict) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports anywhere in its body."""
    found = set()

    def known(dotted: str) -> str | None:  # the module itself, else the package that holds the name
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(filter(None, (known(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else known(base))
    found.discard(None)
    found.discard(name)
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package)
    return {name: _imported(ast.parse(path.read_text()), name, is_package, modules)
            for name, (path, is_package) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
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
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def test_the_cycle_finder_finds_a_circle_of_three_and_nothing_in_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_counts_type_only_and_function_level_imports(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
                     "def f():\n    from . import c\n")
    modules = {"pkg": None, "pkg.a": None, "pkg.b": None, "pkg.c": None}
    assert _imported(tree, "pkg.a", False, modules) == {"pkg.b", "pkg.c"}


def test_no_module_imports_itself_around_a_circle():
    for package in PACKAGES:
        graph = import_graph(package)
        found = cycles(graph)
        described = ["; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found]
        assert not found, (f"import circles in {package}: " + " | ".join(described) + ". Move what the modules "
                           "share below both (a protocol or a dataclass), or have the owner hand the variant in.")


def test_no_module_is_over_600_lines():
    long = {str(path.relative_to(ROOT)): n for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
