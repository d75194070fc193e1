"""The package's import graph (read from the source, nothing imported): no cycle, ``core``
imports no SGLang and nothing of a line, and the two SGLang lines never import each other.

Imports inside functions count too: the circle this pins (``server_args`` and the KV mixin
importing ``plugin`` for the hook check, ``plugin`` importing them) went through them.
Only ``if TYPE_CHECKING:`` imports, which never run, are left out. Runs in both venvs.
"""

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import sglang_cp_hicache

ROOT = Path(sglang_cp_hicache.__file__).parent
PACKAGE = "sglang_cp_hicache"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """Every import statement that can run (module level or in a function)."""
    pending: List[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def _parents(name: str) -> Set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _edges(importer: str, imported: str, modules: Set[str]) -> Set[str]:
    """``imported`` and the packages its import runs first (``a.b.c`` runs ``a``, ``a.b``),
    less the importer's own packages: they are already running when it is imported."""
    return ({imported} | (_parents(imported) - _parents(importer))) & modules


def import_graph() -> Dict[str, Set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: Set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edges |= _edges(name, alias.name, modules)
                continue
            base: Optional[str] = node.module
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base is None:
                continue
            edges |= _edges(name, base, modules)
            for alias in node.names:  # ``from pkg import submodule``
                if f"{base}.{alias.name}" in modules:
                    edges.add(f"{base}.{alias.name}")
        edges.discard(name)
        graph[name] = edges
    return graph


def imported_names(path: Path, name: str) -> Set[str]:
    """Every absolute module name ``path`` (module ``name``) may import, ours or not."""
    is_package = path.name == "__init__.py"
    names: Set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base: Optional[str] = node.module
        if node.level:
            anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        if base is not None:
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _modules_under(*prefixes: str) -> Dict[str, Path]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {n: p for n, p in files.items() if any(n == q or n.startswith(q + ".") for q in prefixes)}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_package_has_no_import_cycle():
    graph = import_graph()
    assert "sglang_cp_hicache.v0_5_12.hooks" in graph["sglang_cp_hicache.v0_5_12.server_args"]  # the graph is real
    assert "sglang_cp_hicache.sim.config" in graph["sglang_cp_hicache.sim"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_no_sglang_and_no_line():
    core = _modules_under(f"{PACKAGE}.core")
    assert f"{PACKAGE}.core.cp_shared_kv_layout" in core  # the scan is real
    offending = {
        name: sorted(
            imported
            for imported in imported_names(path, name)
            if _within(imported, "sglang") or (_within(imported, PACKAGE) and not _within(imported, f"{PACKAGE}.core"))
        )
        for name, path in core.items()
    }
    assert {name: found for name, found in offending.items() if found} == {}


LINES = ("v0_5_12", "v0_5_23")


def _line_prefixes(line: str) -> tuple:
    return (f"{PACKAGE}.{line}", f"{PACKAGE}.testing.{line}", f"{PACKAGE}.sim.{line}")


def test_the_two_lines_never_import_each_other():
    for line in LINES:
        others = [p for other in LINES if other != line for p in _line_prefixes(other)]
        crossing = {
            name: sorted(i for i in imported_names(path, name) if any(_within(i, p) for p in others))
            for name, path in _modules_under(*_line_prefixes(line)).items()
        }
        assert {name: found for name, found in crossing.items() if found} == {}, line


def test_line_scan_finds_a_planted_crossing(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from sglang_cp_hicache.v0_5_23 import hooks\n")
    assert f"{PACKAGE}.v0_5_23" in imported_names(planted, f"{PACKAGE}.v0_5_12.planted")
    relative = tmp_path / "rel.py"
    relative.write_text("from ..core import releases\n")
    assert f"{PACKAGE}.core.releases" in imported_names(relative, f"{PACKAGE}.v0_5_12.rel")


def _product_modules() -> Dict[str, Path]:
    """The installed plugin: everything but the CPU runtime and test harnesses (``testing``)
    and the simulator (``sim``)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {n: p for n, p in files.items() if not (_within(n, f"{PACKAGE}.testing") or _within(n, f"{PACKAGE}.sim"))}


def test_the_product_never_imports_the_cpu_runtime_or_harnesses():
    product = _product_modules()
    assert f"{PACKAGE}.v0_5_23.launch.flag" in product and f"{PACKAGE}.testing.server.runtime" not in product
    offending = {
        name: sorted(i for i in imported_names(path, name) if _within(i, f"{PACKAGE}.testing") or _within(i, f"{PACKAGE}.sim"))
        for name, path in product.items()
    }
    assert {name: found for name, found in offending.items() if found} == {}
