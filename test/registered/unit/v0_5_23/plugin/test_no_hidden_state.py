"""The 0.5.23 line keeps its state in objects it owns (one ``CpCacheExtension`` per sharded
cache), never in hidden channels: no context variables, no ``setattr`` / ``vars()`` on
another object, no module-level mutable state. Reads the source (``ast``), imports
nothing of the line.

The few sites that remain are listed below, each with why; a new one fails the test, and
so does a listed one that is gone (the list must shrink with the code)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Set, Tuple

import sglang_cp_hicache

LINE = Path(sglang_cp_hicache.__file__).parent / "v0_5_23"

# (module path under v0_5_23/, what) -> why it stays
KNOWN = {
    ("launch/server_args.py", "setattr"): "the mode's own field on the sealed ServerArgs record (the flag, resolution's decision)",
    ("launch/server_args.py", "vars"): "argparse's Namespace of from_cli_args, not an SGLang object",
    ("launch/server_args.py", "_warned_spellings"): "a 0.5.12 spelling is warned about once per process",
    ("launch/server_args.py", "LEGACY_CP_STRATEGIES"): "a constant table, never written",
    ("launch/dsa_backend_rule.py", "ADMITTED"): "a constant table, never written",
    ("launch/dsa_backend_rule.py", "_UPSTREAM_TRIPLE"): "a constant table, never written",
    ("selftest/kv_shard_selftest.py", "SELFTEST_KERNELS"): "a constant table, never written",
    ("selftest/kv_shard_selftest.py", "setattr"): "the startup self-test's report on the model runner",
    ("resolution_steps.py", "_step_wrappers"): "registration is once per process: the wrappers SGLang holds",
    ("resolution_steps.py", "_step_errors"): "registration is once per process: why a step was refused",
    ("cache/cache_extension.py", "_EXTENSIONS"): "the one lookup from an SGLang object to its cache's extension (weak)",
    ("admission/request_limits.py", "_LIMITS"): "the one lookup from a tokenizer manager to its request limits (weak)",
}

_MUTABLE_CALLS = {
    "set", "dict", "list", "Counter", "defaultdict", "deque", "OrderedDict",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "ContextVar",
}  # fmt: skip


def _is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _MUTABLE_CALLS or name.endswith("Stats")
    return False


def _findings(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "contextvars" for a in node.names):
            yield "contextvars"
        if isinstance(node, ast.ImportFrom) and node.module == "contextvars":
            yield "contextvars"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("setattr", "vars"):
                yield node.func.id
    for node in tree.body:  # module level only
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        value = getattr(node, "value", None)
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or value is None:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id != "__all__" and _is_mutable(value):
                yield target.id


def _found() -> Set[Tuple[str, str]]:
    return {
        (path.relative_to(LINE).as_posix(), what)
        for path in sorted(LINE.rglob("*.py"))
        for what in _findings(path)
    }


def test_no_new_hidden_state_in_the_line() -> None:
    new = sorted(_found() - set(KNOWN))
    assert not new, (
        f"hidden state in v0_5_23/ (context variables, setattr/vars on another object, "
        f"module-level mutable state): {new}; keep it on the cache's extension instead"
    )


def test_every_listed_site_still_exists() -> None:
    assert not sorted(set(KNOWN) - _found()), "remove the sites that are gone from KNOWN"


def test_the_scan_sees_each_kind(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import contextvars\nSTATS = LaneStats()\nSEEN = set()\n__all__ = []\n"
        "def hook(op):\n    setattr(op, 'x', 1)\n    return vars(op)\n"
    )
    assert sorted(_findings(planted)) == ["SEEN", "STATS", "contextvars", "setattr", "vars"]
