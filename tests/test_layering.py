"""The package's layering: every import inside ``spcompile`` points to its own layer or one below,
and there is no import cycle except the registries' register-on-import.

Layers, bottom to top (``docs/architecture.md`` explains them)::

    core, _version < runtime < passes < kernels < artifact < module < compile < autotune < api < nn < cli < spcompile

Function-local imports count like module-level ones: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import os

import pytest

import spcompile

PKG_DIR = os.path.dirname(os.path.abspath(spcompile.__file__))

LAYERS = ["core", "runtime", "passes", "kernels", "artifact", "module", "compile", "autotune", "api", "nn", "cli",
          "__init__"]
SAME_LAYER = {"_version": "core", "__main__": "__init__"}

#: (importer, imported) pairs that may point up; the issue's budget is at most two
ALLOWED_UP: set[tuple[str, str]] = set()
#: register-on-import: a registry module imports the module that registers the built-ins into it
REGISTRY_EDGES = {("spcompile.kernels.base", "spcompile.kernels.builtin"),
                  ("spcompile.passes.base", "spcompile.passes.builtin")}


def _modules() -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG_DIR))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    top = SAME_LAYER.get(top, top)
    return LAYERS.index(top)


def _imports(mod: str, path: str) -> set[str]:
    """Modules of the package that ``mod`` imports (anywhere in its body)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[: len(base) - (node.level - 1)]
                target = ".".join(pkg + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("spcompile"):
                continue
            for alias in node.names:   # "from . import x" may name a submodule
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("spcompile"):
                    out.add(alias.name)
    out = {t for t in out if t in MODULES and t != mod}
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_layer_table_covers_every_module():
    for m in MODULES:
        layer_of(m)   # raises ValueError for a top-level name with no layer


def test_no_import_points_up():
    up = sorted((a, b) for a, deps in GRAPH.items() for b in deps
                if layer_of(b) > layer_of(a) and (a, b) not in ALLOWED_UP)
    assert not up, "imports that point to a higher layer:\n" + "\n".join(f"  {a} -> {b}" for a, b in up)
    assert len(ALLOWED_UP) <= 2


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):   # iterative Tarjan would be longer; the package graph is shallow
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_but_registries():
    graph = {a: {b for b in deps if (a, b) not in REGISTRY_EDGES} for a, deps in GRAPH.items()}
    cycles = [c for c in _sccs(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("edge", sorted(REGISTRY_EDGES))
def test_registry_edges_exist(edge):
    """The exceptions above name real imports (a stale exception would hide nothing)."""
    a, b = edge
    assert b in GRAPH[a]


def test_cycle_detector_finds_a_planted_cycle():
    comps = sorted(_sccs({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}))
    assert comps == [["a", "b", "c"], ["d"]]
