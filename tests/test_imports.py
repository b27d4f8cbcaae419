"""The package's import graph has no cycles, and the ops never import the benchmark.

The graph is read from the source with ``ast``: every ``import`` anywhere in
a module (inside functions too, as those run when the function is called),
except under ``if TYPE_CHECKING:``. An import names its module only, not the
packages above it, which Python runs first but which do not depend on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the package at ``root``: its .py files and
    its compiled extensions (``_C.abi3.so``: the tests run on a built tree), in
    folders that are packages (have an __init__.py)."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".so", ".pyd")):
        rel = path.relative_to(root.parent)
        folders = [root.parent.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
        if not all((f / "__init__.py").is_file() for f in folders):
            continue
        stem = rel.name.split(".")[0]  # _C.abi3.so -> _C
        parts = rel.parts[:-1] + (() if stem == "__init__" else (stem,))
        out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:  # the longest prefix that is one of the package's modules
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            out.update(filter(None, (known(a.name) for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                target = known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                if target:
                    out.add(target)
    out.discard(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(name, path, modules) if path.suffix == ".py" else set() for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another (a strongly connected
    component of two or more), as one cycle through it: [a, b, ..., a]."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, g) for g in groups]


def _one_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover  (a component always has one)


def test_the_package_has_no_import_cycles():
    graph = import_graph(SRC / "opforge")
    # the graph is really read: known edges are in it
    assert "opforge.bench.harness" in graph["opforge.bench.cli_args"]
    assert "opforge.bench.results" in graph["opforge.bench.report"]
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_ops_do_not_import_the_benchmark():
    graph = import_graph(SRC / "opforge")
    ops = {name for name in graph if name == "opforge.ops" or name.startswith("opforge.ops.")}
    assert "opforge.ops.add" in ops
    bad = {(m, t) for m in ops for t in graph[m] if t.startswith("opforge.bench")}
    assert not bad, bad


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_cycle_check_finds_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    _write(
        pkg,
        {
            "__init__.py": "",
            "a.py": "from . import b\n",
            "b.py": "def f():\n    from .sub.c import g\n",  # a function-level import counts
            "sub/__init__.py": "",
            "sub/c.py": "import pkg.a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n",
            "e.py": "from .d import x\n",  # d -> e only under TYPE_CHECKING: no cycle
            "f.py": "from .a import something\n",  # into the cycle, not part of it
            "notapkg/g.py": "from pkg import a\n",  # no __init__.py: not a module of the package
        },
    )
    graph = import_graph(pkg)
    assert "pkg.notapkg.g" not in graph
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.f"] == {"pkg.a"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


@pytest.mark.parametrize(
    "text, expect",
    [
        ("from .. import a\n", {"pkg.a"}),  # a module of the parent
        ("from .. import VERSION\n", {"pkg"}),  # a name in the parent's __init__
        ("from ..a import thing\n", {"pkg.a"}),
        ("import pkg.sub\n", {"pkg.sub"}),
        ("from .. import _C\n", {"pkg._C"}),  # a compiled extension module
    ],
)
def test_relative_and_absolute_imports_resolve(tmp_path, text, expect):
    pkg = tmp_path / "pkg"
    _write(pkg, {"__init__.py": "", "a.py": "", "_C.abi3.so": "", "sub/__init__.py": "", "sub/m.py": text})
    assert import_graph(pkg)["pkg.sub.m"] == expect
