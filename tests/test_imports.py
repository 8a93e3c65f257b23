"""No import cycles inside the ``gmlx`` package, counting every import there is.

Every module is read with ``ast`` (nothing is imported), and every import in it is an
edge: at module level, under ``if TYPE_CHECKING:`` and inside functions alike. A
cycle that only a lazy import closes today becomes an ``ImportError`` the day
someone hoists that import, and a ``TYPE_CHECKING`` cycle says two modules know each
other's insides; so all of them count.

How imports become edges:
    - relative imports are resolved against the importing module's package;
    - ``from gmlx.x import y`` is an edge to ``gmlx.x.y`` when ``y`` is a submodule,
      and to ``gmlx.x`` when ``y`` is a name defined there (importing only submodules
      runs ``gmlx.x`` as an implicit parent, like ``import gmlx.x.y``);
    - importing a package is an edge to its ``__init__`` (the package's own name).
The parents a module's import runs implicitly (``gmlx``, ``gmlx.engine``) are not
edges: ``gmlx/__init__.py`` lazily imports a loader for ``gmlx.load_tokenizer``, so
counting them would put every module in one cycle through the root.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "gmlx"
PACKAGE = "gmlx"


@dataclass(frozen=True)
class Edge:
    target: str
    where: str  # "path:line" of the first import that makes it


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a ``from`` import's module (``level`` dots before ``name``)."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every in-package module that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    rel = path.relative_to(ROOT.parent)
    edges: dict[str, Edge] = {}

    def add(target: str, node: ast.AST) -> None:
        if target in modules and target != module and target not in edges:
            edges[target] = Edge(target, f"{rel}:{node.lineno}")  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            submodules = [f"{source}.{alias.name}" for alias in node.names]
            if not all(name in modules for name in submodules):
                add(source, node)  # a name defined in ``source`` itself
            for name in submodules:
                add(name, node)  # a submodule, when there is one
    return list(edges.values())


def import_graph() -> dict[str, list[Edge]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            edges = graph[node]
            if i < len(edges):
                work.append((node, i + 1))
                nxt = edges[i].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
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
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def cycles_in(component: list[str], graph: dict[str, list[Edge]]) -> list[tuple[str, list[Edge]]]:
    """Shortest cycles that together use every import edge inside ``component``,
    each as its first module and the chain of edges from it back to it."""
    members = set(component)
    inside = {m: [e for e in graph[m] if e.target in members] for m in component}
    covered: set[tuple[str, str]] = set()
    cycles = []
    for source in component:
        for first in inside[source]:
            if (source, first.target) in covered:
                continue
            # Breadth-first from the edge's target back to its source.
            back: dict[str, tuple[str, Edge] | None] = {first.target: None}
            queue = deque([first.target])
            while queue and source not in back:
                node = queue.popleft()
                for edge in inside[node]:
                    if edge.target not in back:
                        back[edge.target] = (node, edge)
                        queue.append(edge.target)
            chain = []
            node = source
            while node != first.target:
                step = back[node]
                assert step is not None
                node, edge = step
                chain.append(edge)
            chain = [first, *reversed(chain)]
            cycles.append((source, chain))
            prev = source
            for edge in chain:
                covered.add((prev, edge.target))
                prev = edge.target
    return cycles


def describe(start: str, chain: list[Edge]) -> str:
    """``a -> b (a.py:3) -> a (b.py:9)``: each arrow names the import that makes it."""
    return start + "".join(f" -> {e.target} ({e.where})" for e in chain)


def test_the_walk_sees_every_kind_of_import():
    graph = import_graph()
    targets = {name: {e.target for e in edges} for name, edges in graph.items()}
    assert "gmlx.engine.types" in targets["gmlx.engine.worker"]  # module level
    assert "gmlx.engine.loading" in targets["gmlx.engine.residency"]  # under TYPE_CHECKING
    assert "gmlx.engine.capacity" in targets["gmlx.engine.worker"]  # inside a function
    assert "gmlx.engine.loading.demo" in targets["gmlx.engine.loading"]  # `from pkg import submodule`


def test_resolving_relative_imports():
    assert _resolve("gmlx.engine.worker", False, 1, "types") == "gmlx.engine.types"
    assert _resolve("gmlx.engine.loading", True, 1, "demo") == "gmlx.engine.loading.demo"
    assert _resolve("gmlx.engine.loading.gguf", False, 2, None) == "gmlx.engine"


def test_the_cycle_finder_reports_each_cycle_as_a_chain():
    graph = {
        "a": [Edge("b", "a.py:1")],
        "b": [Edge("c", "b.py:1"), Edge("a", "b.py:2")],
        "c": [Edge("a", "c.py:1")],
        "d": [Edge("a", "d.py:1")],
    }
    (component,) = strongly_connected(graph)
    assert component == ["a", "b", "c"]  # d only leads into it
    assert {describe(start, chain) for start, chain in cycles_in(component, graph)} == {
        "a -> b (a.py:1) -> a (b.py:2)",
        "b -> c (b.py:1) -> a (c.py:1) -> b (a.py:1)",
    }


def test_no_import_cycles():
    graph = import_graph()
    report = []
    for component in strongly_connected(graph):
        report.append(f"cycle among {', '.join(component)}:")
        for start, chain in cycles_in(component, graph):
            report.append("  " + describe(start, chain))
    assert not report, "import cycles in gmlx:\n" + "\n".join(report)
