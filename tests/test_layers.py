"""The layer rule of docs/architecture.md, read from the source: core/ imports nothing above it and has no import cycle.

Every import counts, at module level or inside a function (a lazy import that closes a cycle is still a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import hchain_viz

PACKAGE = Path(hchain_viz.__file__).parent
CORE = PACKAGE / "core"
# What core/ may import from the package: itself and the error classes. Nothing above it (runtime, viz, bench, the
# command line, the package's lazy top level).
ALLOWED_INTERNAL = ("hchain_viz.core", "hchain_viz.errors")
# Third-party modules of the upper layers: core/ runs and is taught without them.
FORBIDDEN_EXTERNAL = ("torch", "torchvision", "plotly", "ipywidgets", "anywidget", "IPython", "traitlets")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; ``from X import y`` names ``X.y`` as well when y is
    a module of the package (``from . import device``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub.startswith("hchain_viz.") and _source(sub) is not None:
                    found.append((node.lineno, sub))
    return found


def _source(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for p in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if p.is_file():
            return p
    return None


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def test_core_imports_nothing_above_it():
    bad = []
    for path in core_modules().values():
        for line, target in imports_of(path):
            internal_ok = any(target == a or target.startswith(a + ".") for a in ALLOWED_INTERNAL)
            if target.split(".")[0] == "hchain_viz" and not internal_ok:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
            if target.split(".")[0] in FORBIDDEN_EXTERNAL:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not bad, "core/ must import only core/ and errors.py (docs/architecture.md):\n" + "\n".join(bad)


def test_core_has_no_import_cycle():
    modules = core_modules()
    graph = {name: sorted({t for _, t in imports_of(path) if t in modules and t != name and t != "hchain_viz.core"})
             for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles in core/ (a function belongs on the higher module):\n" + "\n".join(
        f"{len(comp)} modules import one another ({', '.join(comp)}), e.g. {' -> '.join(cycle)}"
        for comp, cycle in cycles)


def _cycles(graph: dict[str, list[str]]) -> list[tuple[list[str], list[str]]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm), sorted, with one cycle
    through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return [(sorted(comp), _cycle_in(graph, set(comp))) for comp in components]


def _cycle_in(graph: dict[str, list[str]], comp: set[str]) -> list[str]:
    """The shortest path start -> ... -> start within one strongly connected component (breadth first)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        ahead = []
        for v in frontier:
            for w in graph[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*path[::-1], start]
                if w in comp and w not in prev:
                    prev[w] = v
                    ahead.append(w)
        frontier = ahead
    raise AssertionError(f"{sorted(comp)} is not strongly connected")


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The helpers above find what they are for (on a made-up graph and on a package module that imports upward)."""
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a", "b"], "d": ["a"]}) == [(["a", "b", "c"], ["a", "b", "c", "a"])]
    assert _cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []
    upward = [t for _, t in imports_of(PACKAGE / "viz" / "explorer.py")]
    assert "hchain_viz.core.device" in upward and any(t.startswith("hchain_viz.runtime.") for t in upward)
    assert "IPython" in upward  # imported inside a function


def test_no_import_cycle_within_runtime_or_viz():
    """The same rule one layer up: runtime/ (runtime/stages.py and runtime/graph/ once imported each other) and
    viz/ (html.py and pipeline.py once did). A package's own ``__init__`` importing its modules does not count."""
    for layer in ("runtime", "viz"):
        modules = {module_name(p): p for p in sorted((PACKAGE / layer).rglob("*.py"))}
        graph = {name: sorted({t for _, t in imports_of(path) if t in modules and t != name
                               and not (modules[t].name == "__init__.py" and name.startswith(t + "."))})
                 for name, path in modules.items()}
        cycles = _cycles(graph)
        assert not cycles, f"import cycles in {layer}/:\n" + "\n".join(' -> '.join(cycle) for _, cycle in cycles)
