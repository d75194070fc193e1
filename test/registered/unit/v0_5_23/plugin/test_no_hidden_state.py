"""The 0.5.23 line keeps its state in objects it owns (one ``CpCacheExtension`` per sharded
cache), never in hidden channels: no context variables, no ``setattr`` / ``vars()`` on
another object, no module-level mutable state, no block-scoped state (a
``contextmanager`` that sets a value for the calls inside it), no name rebound on an SGLang
module (``binding_swapped``) where SGLang gives a seam. Reads the source (``ast``), imports
nothing of the line but the extension's class.

The few sites that remain are listed below, each with why; a new one fails the test, and
so does a listed one that is gone (the list must shrink with the code). The extension's own
fields are listed too: each outlives a call (a field one hook sets and another reads within
a call is what a frozen value or a view passed with the call replaced)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Set, Tuple

import sglang_cp_hicache

LINE = Path(sglang_cp_hicache.__file__).parent / "v0_5_23"

# (module path under v0_5_23/, what) -> why it stays
KNOWN = {
    ("launch/cp_mode.py", "setattr"): "the mode on the sealed ServerArgs record: the one object SGLang carries to every scheduler, no plugin field (store_mode, its one writer)",
    ("launch/cli.py", "vars"): "argparse's Namespace of from_cli_args, not an SGLang object",
    ("launch/legacy_spellings.py", "_warned_spellings"): "a 0.5.12 spelling is warned about once per process",
    ("launch/legacy_spellings.py", "LEGACY_CP_STRATEGIES"): "a constant table, never written",
    ("launch/dsa_backend_rule.py", "ADMITTED"): "a constant table, never written",
    ("launch/dsa_backend_rule.py", "_UPSTREAM_TRIPLE"): "a constant table, never written",
    ("launch/gate_view.py", "binding_swapped"): "upstream's gate reads the record through its module-global resolving_view and takes no view; a hook on resolving_view would change every resolution step",
    ("storage/runtime_attach.py", "binding_swapped"): "upstream's attach checks sharding through its module-global page_interleave_shard_size; a hook on it would run on every allocation",
    ("backup/l2_transfer.py", "contextmanager"): "the D2H stream made current for a copy (core.per_layer_backup.BackupStreams), no value kept",
    ("selftest/kv_shard_selftest.py", "SELFTEST_KERNELS"): "a constant table, never written",
    ("selftest/kv_shard_selftest.py", "setattr"): "the startup self-test's report on the model runner",
    ("resolution_steps.py", "_step_wrappers"): "registration is once per process: the wrappers SGLang holds",
    ("resolution_steps.py", "_step_errors"): "registration is once per process: why a step was refused",
    ("cache/cache_extension.py", "_EXTENSIONS"): "the one lookup from an SGLang object to its cache's extension (weak)",
    ("admission/request_limits.py", "_LIMITS"): "the one lookup from a tokenizer manager to its request limits (weak)",
}

# The extension's fields (``CpCacheExtension.__init__``): each replicated and long-lived.
EXTENSION_FIELDS = {
    "mode": "the mode it was built under (frozen)",
    "cache": "its cache",
    "allocator": "its cache's sharded allocator",
    "chain_starts": "new chains started per base, since the allocator was built",
    "device_stats": "device lane-eviction counts, since the cache was built",
    "host_stats": "host room counts, since the cache was built",
    "device_leaves": "the device tier's candidate heap, kept across plans",
    "metrics": "the plugin's Prometheus series (decided once: --enable-metrics), since the cache was built",
    "host_leaves": "the host tier's candidate heap, kept across plans",
    "host_lanes": "whether the host pool is the sharded one (decided once at init_hicache)",
    "layer_backup": "the per-layer backup (attached once at init_hicache)",
    "_pool_listeners": "which pool feeds which backup stage (attached once)",
    "start_owners": "each L3 prefetch's start owner, weakly by operation (dies with it)",
    "anchor_skips": "prefetches not issued under a pending backup, counted",
    "l3_events": "storage writes' KV events held until their ack; the L3 blocks published as stored",
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
            if node.func.id in ("setattr", "vars", "binding_swapped"):
                yield node.func.id
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", "")
                if name == "contextmanager":
                    yield "contextmanager"
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
        "import contextlib, contextvars\nSTATS = LaneStats()\nSEEN = set()\n__all__ = []\n"
        "def hook(op):\n    setattr(op, 'x', 1)\n    return vars(op)\n"
        "@contextlib.contextmanager\ndef opened(extension, value):\n    yield\n"
        "def gate(module):\n    return binding_swapped(module, 'name', lambda f: f)\n"
    )
    assert sorted(_findings(planted)) == [
        "SEEN", "STATS", "binding_swapped", "contextmanager", "contextvars", "setattr", "vars",
    ]  # fmt: skip


def _extension_fields() -> Set[str]:
    tree = ast.parse((LINE / "cache" / "cache_extension.py").read_text())
    init = next(
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "CpCacheExtension"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "__init__"
    )
    return {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and getattr(target.value, "id", "") == "self"
    }


def test_the_extension_holds_only_long_lived_fields() -> None:
    fields = _extension_fields()
    assert "device_leaves" in fields  # the scan is real
    assert fields == set(EXTENSION_FIELDS), (
        f"new: {sorted(fields - set(EXTENSION_FIELDS))}; gone: {sorted(set(EXTENSION_FIELDS) - fields)}. "
        "A decision one hook makes and another applies within a call travels with the call "
        "(a frozen value, a view of the cache), not on the extension"
    )
