"""The packages of specserve import each other without cycles: a package (a folder under specserve/, or a
top-level module) can be read and changed knowing only the ones below it. Every import counts, including
function-level and type-checking-only ones."""

from __future__ import annotations

import ast
from pathlib import Path

import specserve

ROOT = Path(specserve.__file__).parent


def _package(module: str) -> str:
    """specserve.a.b -> "a"; the root package itself -> "specserve"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, dict[str, set[str]]]:
    """package -> {imported package -> {importing module}} over specserve's own modules."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("specserve", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        src = _package(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name == "specserve" or name.startswith("specserve."):
                    dst = _package(name)
                    if dst != src:
                        graph.setdefault(src, {}).setdefault(dst, set()).add(module)
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """A cycle of packages as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_find_cycle_on_hand_made_graphs():
    assert find_cycle({"a": {"b": set()}, "b": {"c": set()}}) is None
    assert find_cycle({"a": {"b": set()}, "b": {"c": set()}, "c": {"a": set()}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": set()}, "b": {"b2": set()}, "b2": {"b": set()}}) == ["b", "b2", "b"]


def test_the_package_graph_has_no_cycle():
    graph = import_graph()
    assert {"scheduler", "speculative", "attention", "models"} <= set(graph)  # the walk saw the code
    cycle = find_cycle(graph)
    edges = ([f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:], strict=False)]
             if cycle else [])
    assert cycle is None, "import cycle between packages:\n" + "\n".join(edges)
