"""The import graph of the `infertune` package has no circles.

Files are the nodes; an arrow runs from a file to every infertune file it imports: `import infertune.x`,
`from infertune.x import y` (y itself when it is a submodule) and relative imports, wherever they stand — at module
level, inside functions, under `if TYPE_CHECKING:` or `try:`. (Importing `infertune.a.b` also runs the packages'
`__init__.py` files on the way; those implicit arrows are not drawn, or every package facade would close a circle.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "infertune"

Graph = dict[str, dict[str, int]]  # file -> {imported file: line of the first such import}


def _module_file(module: str) -> str | None:
    """The file of a dotted module name under the repository root, or None when there is none."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(ROOT).as_posix()
    return None


def _package_of(rel: str) -> list[str]:
    """The dotted package a file belongs to (its own folder for an __init__.py), as parts."""
    parts = rel.removesuffix(".py").split("/")
    return parts[:-1]


def _imported(rel: str, node: ast.AST) -> list[str]:
    """Dotted infertune module names an import node refers to (a `from` import also names each candidate submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "infertune" or a.name.startswith("infertune.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        pkg = _package_of(rel)
        if node.level > 1:
            pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base != "infertune" and not base.startswith("infertune."):
        return []
    return [base] + [f"{base}.{a.name}" for a in node.names if a.name != "*"]


def _targets(rel: str, node: ast.AST) -> list[str]:
    """The infertune files an AST node (in file `rel`) imports; none for a node that is not an import."""
    names = _imported(rel, node)
    if not (isinstance(node, ast.ImportFrom) and names):
        return [f for f in map(_module_file, names) if f]
    base, subs = names[0], names[1:]
    targets = [f for f in map(_module_file, subs) if f]  # `from pkg import submodule`
    if len(targets) < len(subs):  # the other names are attributes of the module itself
        targets.append(_module_file(base))
    return [f for f in targets if f]


def import_graph() -> Graph:
    graph: Graph = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        edges = graph.setdefault(rel, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            for target in _targets(rel, node):
                if target != rel:
                    edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm (iterative): every component of more than one file, each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                    components.append(sorted(component))
    return sorted(components)


def a_cycle(graph: Graph, component: list[str]) -> list[str]:
    """One circle through the component's first file, as a path that ends where it starts (breadth-first: shortest)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in graph[node]:
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def describe(graph: Graph, cycle: list[str]) -> str:
    return "\n    ".join(f"{a}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:]))


def without(graph: Graph, arrows) -> Graph:
    cut = set(arrows)
    return {a: {b: line for b, line in edges.items() if (a, b) not in cut} for a, edges in graph.items()}


def test_graph_sees_every_kind_of_import():
    """The resolver itself: absolute, `from pkg import submodule`, relative, in functions and TYPE_CHECKING."""
    rel = "infertune/serve/api_server.py"
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from infertune.engine.outputs import RequestOutput\n"
        "def f():\n    from . import protocol\n    from .responses import sse\n    import infertune.serve.metrics\n"
        "    from infertune.bench import offline\n    from infertune import LLM\n"
    )
    found = {f for node in ast.walk(ast.parse(src)) for f in _targets(rel, node)}
    assert found == {
        "infertune/engine/outputs.py",
        "infertune/serve/protocol.py",
        "infertune/serve/responses.py",
        "infertune/serve/metrics.py",
        "infertune/bench/offline.py",
        "infertune/__init__.py",
    }


def test_cycle_finder_reports_the_files():
    graph = {"a.py": {"b.py": 1}, "b.py": {"c.py": 2}, "c.py": {"a.py": 3, "d.py": 4}, "d.py": {}}
    assert strongly_connected(graph) == [["a.py", "b.py", "c.py"]]
    assert a_cycle(graph, ["a.py", "b.py", "c.py"]) == ["a.py", "b.py", "c.py", "a.py"]
    assert strongly_connected(without(graph, [("c.py", "a.py")])) == []


def test_import_graph_has_no_cycles():
    graph = import_graph()
    rest = strongly_connected(graph)
    report = [
        f"circle of {len(c)} files ({', '.join(c)}), e.g.\n    {describe(graph, a_cycle(graph, c))}" for c in rest
    ]
    assert not report, "import circles (files as nodes):\n" + "\n".join(report)
