"""Imports go only downward: no import cycle among the package's modules and no module
reaching into another's private (``_name``) names.

The check reads the source (``ast``), so it sees every import, at module level and inside
functions alike (a function-level import only defers a cycle to the first call; it does not
remove it). Packages scanned: ``policyopt``, ``configs``, ``experiments``, ``benchmarks``.

An import makes an edge from the importing module to each module it runs: ``import a.b``
and ``from a import b`` (``b`` a submodule) run ``a.b``; ``from a import name`` runs ``a``
(its ``__init__.py``); and each also runs the packages around its target that are not
around the importer (``policyopt.sharding`` importing ``policyopt.models.sharding`` ran
``policyopt/models/__init__.py``, hence the whole model: a cycle). A package's own modules
importing each other (``from policyopt.rewards import math`` in ``policyopt.rewards.scoring``)
do not run its ``__init__.py`` again: no edge. A message names the importing module, the
line and the imported name.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("policyopt", "configs", "experiments", "benchmarks")
# Infrastructure that the model code may use, so it must never use the model code.
INFRA = ("policyopt.sharding", "policyopt.checkpoint", "policyopt.metrics")


@dataclasses.dataclass(frozen=True)
class Import:
    """One imported name: ``importer`` (module) loads ``target`` (module) at ``line``;
    ``name`` is what the statement names (``from target import name``), or ``None`` when
    the target is a module: ``import target``, or ``from package import submodule``."""

    importer: str
    target: str
    name: str | None
    line: int
    package: str | None = None  # `from package import submodule`: the package

    def where(self) -> str:
        if self.name:
            what = f"from {self.target} import {self.name}"
        elif self.package:
            what = f"from {self.package} import {self.target.rpartition('.')[2]}"
        else:
            what = f"import {self.target}"
        return f"{self.importer} line {self.line}: {what}"


def module_name(path: Path) -> str:
    """``policyopt/rl/loop/trainer.py`` -> ``policyopt.rl.loop.trainer``; a package's
    ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    """Every module of ``PACKAGES``, by dotted name."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


def resolve(importer: str, is_package: bool, module: str | None, level: int) -> str:
    """The absolute module of ``from <level dots><module> import ...`` in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def parse(source: str, name: str = "<unknown>") -> ast.Module:
    """``ast.parse`` with the garbage collector paused: CPython 3.11's AST constructor
    raises SystemError ("AST constructor recursion depth mismatch") when a finalizer runs
    Python code mid-parse, as orbax's un-retrieved tasks do after a failed restore in an
    earlier test of the same worker (they log from theirs). No collection first: in a worker
    whose heap holds compiled models a full collection per file cost ~90 s per test."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=name)
    finally:
        if enabled:
            gc.enable()


def imports_of(name: str, source: str, is_package: bool, modules: set[str]) -> list[Import]:
    """Every import statement of module ``name`` (at module level and inside functions) as
    ``Import`` records; ``target`` is the module loaded (a submodule when ``from a import b``
    names one of ``modules``)."""
    tree = parse(source, name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                continue
            package = resolve(name, is_package, node.module, node.level)
            for alias in node.names:
                submodule = f"{package}.{alias.name}"
                if submodule in modules:
                    found.append(Import(name, submodule, None, node.lineno, package))
                else:
                    found.append(Import(name, package, alias.name, node.lineno))
    return found


def private_attributes(name: str, source: str, is_package: bool, modules: set[str]) -> list[str]:
    """``module._name`` read through a module that ``name`` imported (``import a.b``,
    ``from a import b`` with ``b`` one of ``modules``): the attribute form of importing a
    private name. Each as ``"<name> line <n>: <module>._name"``."""
    tree = parse(source, name)
    bound: dict[str, str] = {}  # local name -> the module it holds
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            source_module = resolve(name, is_package, node.module, node.level)
            for alias in node.names:
                if f"{source_module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{source_module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        module = ".".join([bound[value.id], *chain])
        if module in modules and module != name:
            found.append(f"{name} line {node.lineno}: {module}.{node.attr}")
    return found


@pytest.fixture(scope="module")
def all_imports() -> list[Import]:
    files = source_files()
    modules = set(files)
    return [
        record
        for name, path in files.items()
        for record in imports_of(name, path.read_text(), path.name == "__init__.py", modules)
    ]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (node -> successors) with more
    than one node, each sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def cycle_in(
    component: list[str], edges: dict[tuple[str, str], Import]
) -> list[tuple[Import, str]]:
    """One cycle through the first module of a strongly connected ``component``: the import
    statements that close it, each with the module it runs (breadth-first, so a shortest
    such cycle)."""
    members = set(component)
    start = component[0]
    parent: dict[str, tuple[str, Import]] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for (src, dst), record in sorted(edges.items()):
                if src != node or dst not in members:
                    continue
                if dst == start:
                    path = [(record, dst)]
                    while path[0][0].importer != start:
                        prev = path[0][0].importer
                        path.insert(0, (parent[prev][1], prev))
                    return path
                if dst not in parent:
                    parent[dst] = (src, record)
                    following.append(dst)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def import_graph(
    records: list[Import], prefix: str = "policyopt"
) -> tuple[dict[str, set[str]], dict[tuple[str, str], Import]]:
    """The modules under ``prefix`` as a graph: an edge from each importer to every module
    its imports run, i.e. the target and the target's packages that enclose no importer
    (importing ``a.b.c`` from outside ``a`` runs ``a/__init__.py`` and ``a/b/__init__.py``
    first, which may import more). Returns the graph and one import statement per edge."""
    graph: dict[str, set[str]] = {}
    edges: dict[tuple[str, str], Import] = {}
    for record in records:
        if not (record.importer.startswith(prefix) and record.target.startswith(prefix)):
            continue
        parts = record.target.split(".")
        loaded = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for module in loaded:
            if record.importer == module or record.importer.startswith(module + "."):
                continue  # a package containing the importer: initialised before it
            graph.setdefault(record.importer, set()).add(module)
            edges.setdefault((record.importer, module), record)
    return graph, edges


def describe(record: Import, loaded: str) -> str:
    """``record.where()``, saying which package it runs when that is not its target."""
    return record.where() + ("" if loaded == record.target else f"  (runs {loaded})")


def test_walker_sees_both_import_forms():
    """The walker finds module- and function-level imports, resolves relative ones and
    tells a submodule from a name."""
    modules = {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c"}
    source = (
        "from __future__ import annotations\n"
        "import pkg.a\n"
        "from . import b\n"
        "from .a import _hidden, shown\n"
        "def f():\n"
        "    from ..sub import c\n"
        "    from pkg.sub import thing\n"
    )
    records = imports_of("pkg.sub.d", source, False, modules)
    assert [(r.target, r.name, r.line) for r in records] == [
        ("pkg.a", None, 2),
        ("pkg.sub.b", None, 3),
        ("pkg.sub.a", "_hidden", 4),
        ("pkg.sub.a", "shown", 4),
        ("pkg.sub.c", None, 6),
        ("pkg.sub", "thing", 7),
    ]
    assert records[2].where() == "pkg.sub.d line 4: from pkg.sub.a import _hidden"
    assert records[1].where() == "pkg.sub.d line 3: from pkg.sub import b"


def test_walker_sees_private_attributes_of_modules():
    """``lib._x`` through an imported module is found; a class's ``Batch._fields`` and a
    module outside the scanned ones are not."""
    modules = {"pkg", "pkg.lib", "pkg.sub", "pkg.sub.deep"}
    source = (
        "from pkg import lib as lib_alias\n"
        "import pkg.sub.deep\n"
        "from pkg.lib import Batch\n"
        "import os\n"
        "lib_alias._hidden()\n"
        "pkg.sub.deep._cache.clear()\n"
        "Batch._fields, os._exit, lib_alias.public\n"
    )
    assert private_attributes("pkg.user", source, False, modules) == [
        "pkg.user line 5: pkg.lib._hidden",
        "pkg.user line 6: pkg.sub.deep._cache",
    ]


def test_cycle_finder_on_a_hand_made_graph():
    """a -> b -> c -> a is one component and one cycle; d -> a and e alone are none."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    edges = {
        (src, dst): Import(src, dst, None, i)
        for i, (src, dst) in enumerate([("a", "b"), ("b", "c"), ("c", "a"), ("d", "a")])
    }
    assert [(r.importer, loaded) for r, loaded in cycle_in(["a", "b", "c"], edges)] == [
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
    ]


def test_graph_counts_the_packages_an_import_runs():
    """``from p.q.m import x`` in ``r`` runs ``p``, ``p.q`` and ``p.q.m``; in ``p.q.n`` only
    ``p.q.m`` (its packages are already initialised); in ``p.s`` ``p.q`` and ``p.q.m``."""
    records = [
        Import("r", "p.q.m", "x", 1),
        Import("p.q.n", "p.q.m", "x", 2),
        Import("p.s", "p.q.m", "x", 3),
    ]
    graph, edges = import_graph(records, prefix="")
    assert graph == {"r": {"p", "p.q", "p.q.m"}, "p.q.n": {"p.q.m"}, "p.s": {"p.q", "p.q.m"}}
    assert describe(edges["r", "p.q"], "p.q") == "r line 1: from p.q.m import x  (runs p.q)"


def test_walker_reads_the_package(all_imports):
    """The scan sees the real tree: every package, and edges known to exist (the model
    importing the mesh code, a package running its submodules)."""
    importers = {r.importer for r in all_imports}
    assert set(PACKAGES) <= {name.split(".")[0] for name in importers}
    graph, _ = import_graph(all_imports)
    assert "policyopt.sharding" in graph["policyopt.models.layers"]
    assert "policyopt.rewards.compose" in graph["policyopt.rewards.scoring"]
    assert "policyopt.models.transformer" in graph["policyopt.models"]


def test_no_import_cycle(all_imports):
    """No set of policyopt modules imports itself round in a circle, counting imports
    inside functions and the package ``__init__`` files that an import runs."""
    graph, edges = import_graph(all_imports)
    cycles = []
    for component in strongly_connected(graph):
        path = cycle_in(component, edges)
        cycles.append("\n  ".join(describe(r, loaded) for r, loaded in path))
    assert not cycles, "import cycles (each closed by these imports):\n  " + "\n\n  ".join(cycles)


def test_infra_never_imports_models(all_imports):
    """Mesh, checkpoint and metrics code sits below the model: it never imports
    ``policyopt.models`` (the logical-axis rules live in ``policyopt.sharding``)."""
    bad = [
        r.where()
        for r in all_imports
        if r.importer in INFRA and r.target.startswith("policyopt.models")
    ]
    assert not bad, "infrastructure importing the model code:\n  " + "\n  ".join(bad)


def test_no_private_name_imported_across_modules(all_imports):
    """No module imports another module's ``_private`` names, nor reads them through the
    module (``lib._name``): a name that is shared is public, with a docstring, where it is
    defined."""
    bad = [
        r.where()
        for r in all_imports
        if r.name
        and r.name.startswith("_")
        and not r.name.startswith("__")
        and r.target != r.importer
    ]
    files = source_files()
    for name, path in files.items():
        bad += private_attributes(name, path.read_text(), path.name == "__init__.py", set(files))
    assert not bad, "private names used across modules:\n  " + "\n  ".join(bad)


def test_every_project_import_resolves(all_imports):
    """Every import of a module of the project names one that exists (a module moved or
    removed leaves no import of its old name, even inside a function that no test calls)."""
    modules = set(source_files())
    bad = [
        r.where()
        for r in all_imports
        if r.target.split(".")[0] in PACKAGES and r.target not in modules
    ]
    assert not bad, "imports of modules that do not exist:\n  " + "\n  ".join(bad)
