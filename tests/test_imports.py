"""The package's shape: imports go one way, modules and classes stay small.

Read from the source with ``ast`` (nothing is imported), so an import hidden
inside a function or under ``if TYPE_CHECKING`` counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tierd"
# Smell detectors, not quotas (STYLE.md 9): a module a bit over 500 lines or
# a class a bit over 25 methods is fine when it is one concept; these limits
# catch the ones that grew into several.
MAX_LINES = 800
MAX_METHODS = 40

# Known back edges (importer, imported) left out of the graph: none. Add one
# only with a comment saying why and when it goes.
KNOWN_CYCLE_EDGES: frozenset[tuple[str, str]] = frozenset()

# Oversized modules and classes allowed for now: none. Add one only with a
# comment saying why, and delete it when it fits. Files are paths relative to
# tierd/, classes "path:Class".
KNOWN_LONG_MODULES: frozenset[str] = frozenset()
KNOWN_LARGE_CLASSES: frozenset[str] = frozenset()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The tierd modules ``name`` imports anywhere in its source. ``from a.b
    import c`` is the module a.b.c when that is a module, else a.b itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each
    given as one cycle through its members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(cycle_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One import path inside ``component`` that returns to where it began."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:   # breadth first from start, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_cycle_finder_names_the_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_resolution_counts_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from tierd.server import records\n"
                   "def f():\n    from tierd.server.catalog import Catalog\n")
    known = {"tierd.server", "tierd.server.records", "tierd.server.catalog"}
    assert imported("tierd.server.x", src, known) == {"tierd.server.records",
                                                      "tierd.server.catalog"}


def test_no_import_cycles():
    graph = {m: {d for d in deps if (m, d) not in KNOWN_CYCLE_EDGES}
             for m, deps in import_graph().items()}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def package_of(module: str) -> str:
    """``tierd.client.placer`` -> ``tierd.client``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def edges_between(graph: dict[str, set[str]], importer: str,
                  imported_package: str) -> list[str]:
    """Every import of a module of ``imported_package`` by a module of the
    package ``importer``, as "importer -> imported"."""
    return [f"{m} -> {d}" for m in sorted(graph) if package_of(m) == importer
            for d in sorted(graph[m]) if package_of(d) == imported_package]


def test_package_edges_are_named():
    graph = {"tierd.client.hooks": {"tierd.optim.base", "tierd.client.keys"},
             "tierd.optim.base": {"tierd.client.tiered_param"},
             "tierd.client.keys": set(), "tierd.client.tiered_param": set()}
    assert edges_between(graph, "tierd.client", "tierd.optim") == [
        "tierd.client.hooks -> tierd.optim.base"]
    assert edges_between(graph, "tierd.optim", "tierd.client") == [
        "tierd.optim.base -> tierd.client.tiered_param"]


def test_client_and_optim_do_not_import_each_other():
    """The layering of the training side (docs/architecture.md, "Layers"):

        tierd.optim       AdamW, SGD: the optimizers users build
            |   \
            |   tierd.updates   the update engine: buckets, fused and CPU
            |       |           updates, residency, replicas
            v       v
        tierd.client's leaves (tiered_param, copy_stream, capacity,
        placement, optimizers, ...)

    ``tierd.client`` imports nothing of ``tierd.optim``: its session builds
    the engine (``tierd.updates.engine``, the one module of it the client
    imports) and its parts ask it only through the interface in the leaf
    ``tierd.client.optimizers`` (``UpdateEngine``; a tierd optimizer is told
    by the ``TierdOptimizer`` marker). The engine imports nothing of
    ``tierd.optim``: it calls the optimizer it is given.
    """
    graph = import_graph()
    client_to_optim = edges_between(graph, "tierd.client", "tierd.optim")
    optim_to_client = edges_between(graph, "tierd.optim", "tierd.client")
    assert not (client_to_optim and optim_to_client), (
        "tierd.client and tierd.optim import each other: "
        + "; ".join(client_to_optim + optim_to_client))
    assert not client_to_optim, "tierd.client imports tierd.optim: " + "; ".join(client_to_optim)
    engine_to_optim = edges_between(graph, "tierd.updates", "tierd.optim")
    assert not engine_to_optim, "the update engine imports tierd.optim: " + "; ".join(
        engine_to_optim)
    into_engine = [e for e in edges_between(graph, "tierd.client", "tierd.updates")
                   if not e.endswith(" -> tierd.updates.engine")]
    assert not into_engine, ("tierd.client reaches past the engine's interface "
                             "(tierd.client.optimizers): " + "; ".join(into_engine))


def test_modules_stay_under_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexpected = {p: n for p, n in long.items() if p not in KNOWN_LONG_MODULES}
    assert not unexpected, f"modules over {MAX_LINES} lines (split them): {unexpected}"


def test_classes_stay_under_the_method_limit():
    large = {}
    for p in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for b in node.body)
                if n > MAX_METHODS:
                    large[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    unexpected = {c: n for c, n in large.items() if c not in KNOWN_LARGE_CLASSES}
    assert not unexpected, f"classes over {MAX_METHODS} methods (split them): {unexpected}"


def redefined(source: str) -> list[str]:
    """Functions and classes defined twice in one body of ``source`` (module or
    class): the later silently replaces the earlier, so a test pasted twice
    runs only its last copy. Property setters and ``@overload`` are not
    redefinitions."""
    found = []

    def scan(body, where: str) -> None:
        seen: set[str] = set()
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.ClassDef):
                scan(node.body, f"{where}{node.name}.")
            exempt = any(isinstance(d, ast.Attribute)
                         or (isinstance(d, ast.Name) and d.id == "overload")
                         for d in node.decorator_list)
            if node.name in seen and not exempt:
                found.append(f"{where}{node.name} (line {node.lineno})")
            seen.add(node.name)

    scan(ast.parse(source).body, "")
    return found


def test_redefinition_finder_names_the_second_copy():
    source = ("def a(): pass\nclass C:\n    @property\n    def x(self): pass\n"
              "    @x.setter\n    def x(self, v): pass\n    def m(self): pass\n"
              "    def m(self): pass\ndef a(): pass\n")
    assert redefined(source) == ["C.m (line 8)", "a (line 9)"]


def test_no_function_or_class_is_defined_twice_in_the_package_or_its_tests():
    root = PACKAGE.parent
    found = {str(p.relative_to(root)): r for p in sorted([*PACKAGE.rglob("*.py"),
                                                          *(root / "tests").rglob("*.py")])
             if (r := redefined(p.read_text()))}
    assert not found, f"defined twice (the later copy replaces the earlier): {found}"
