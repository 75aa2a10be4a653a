"""The package as a package: no import circles among its modules, one version, test support that
does not reach into the checkout's tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import functional_ema as fe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "functional_ema"


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code (lazy imports count).

    An import of a parent package is left out: Python imports every parent before a module anyway,
    and the package's ``__init__`` importing its submodules is not a circle."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        pkg = name if is_pkg else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [mod, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    graph = import_graph()
    assert "functional_ema._checkpoint.writer" in graph and graph["functional_ema.checkpoint"], "graph not read"
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_checkpoint_internals_never_import_the_public_modules_above_them():
    graph = import_graph()
    public = {"functional_ema.checkpoint", "functional_ema.buffers", "functional_ema._api", "functional_ema.dcp"}
    for name, deps in graph.items():
        if name.startswith("functional_ema._checkpoint"):
            assert not deps & public, f"{name} imports {sorted(deps & public)}"


def test_version_is_the_one_in_version_py_and_pep440():
    text = (PACKAGE / "_version.py").read_text()
    assert re.search(r'^__version__ = "(.+)"$', text, re.M).group(1) == fe.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", fe.__version__)
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    assert f"## {fe.__version__}" in (ROOT / "CHANGELOG.md").read_text(), "CHANGELOG has no entry for this version"


def test_test_support_shipped_in_the_package_does_not_import_the_checkouts_tests():
    for path in (PACKAGE / "_testing").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            assert not any(n == "tests" or n.startswith("tests.") for n in names), f"{path} imports {names}"
