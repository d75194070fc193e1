"""The 0.5.23 line decides its mode once (issue 37): one frozen ``CpMode`` on the record,
settled by the resolution step, read only where the line starts up or resolves; a sharded
cache's per-call hooks ask only whether the cache has an extension. Reads the source
(``ast``), imports nothing of the line but ``cp_mode``.

Every function that reads the mode is listed below with when it runs; a new reader (a
per-call "is the plugin on here?" predicate, say) fails the test, and so does a listed one
that is gone. The record's mode attribute is named only in ``launch/cp_mode.py``: its one
reader (``cp_mode``) and its one writer (``store_mode``)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Set, Tuple

import sglang_cp_hicache
from sglang_cp_hicache.v0_5_23.launch.cp_mode import MODE_ATTR, CpMode

PACKAGE = Path(sglang_cp_hicache.__file__).parent
LINE = PACKAGE / "v0_5_23"

# (module path under v0_5_23/, enclosing function) -> when it runs
MODE_READERS = {
    ("launch/flag.py", "set_cp_shared_kv_enabled"): "the flag stored before resolution",
    ("launch/gate_view.py", "storage_hidden_from_gate.without_storage.view"): "resolution: upstream's gate",
    ("launch/resolution.py", "refuse_and_enable_sharding"): "resolution: where the mode is decided",
    ("launch/resolution.py", "refuse_unsupported_model"): "resolution: the model step",
    ("launch/dsa_backend_rule.py", "validate_dsa_backend_around"): "resolution: upstream's gate",
    ("selftest/kv_shard_selftest.py", "init_attention_backends_after"): "startup, once per runner",
    ("cache/cache_extension.py", "cache_init_after"): "once per cache: whether it gets an extension",
    ("storage/backend_factory.py", "create_backend_around"): "once per L3 backend built",
    ("storage/runtime_attach.py", "attach_around"): "once per admin attach",
    ("launch/pd_bootstrap.py", "register_topology_row_around"): "startup, once per registration",
    ("admission/request_limits.py", "refusal_reason"): "startup, once per tokenizer manager (its AFTER hook)",
}
# Where the record's mode attribute may be named: its one reader and its one writer.
MODE_ATTR_SITES = {
    ("launch/cp_mode.py", "<module>"),
    ("launch/cp_mode.py", "cp_mode"),
    ("launch/cp_mode.py", "store_mode"),
}
# The per-call predicates the mode replaced: none may come back, in the line or its harness.
RETIRED = {
    "cp_shared_kv_enabled",
    "cp_shared_kv_flag_given",
    "is_unsharded_mode",
    "owner_free_storage_enabled",
    "owner_free_keys_enabled",
}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _sites(tree: ast.AST) -> Iterator[Tuple[str, str]]:
    """(enclosing function's dotted name or ``<module>``, what): ``cp_mode`` for a call of
    the reader, ``MODE_ATTR`` for the attribute named by constant or by its string,
    ``def <name>`` for a retired predicate defined."""

    def walk(node: ast.AST, scope: str) -> Iterator[Tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name in RETIRED:
                    yield scope, f"def {child.name}"
                inner = child.name if scope == "<module>" else f"{scope}.{child.name}"
                yield from walk(child, inner)
                continue
            if isinstance(child, ast.Call) and _called_name(child) == "cp_mode":
                yield scope, "cp_mode"
            if isinstance(child, ast.Name) and child.id == "MODE_ATTR":
                yield scope, "MODE_ATTR"
            if isinstance(child, ast.Constant) and child.value == MODE_ATTR:
                yield scope, "MODE_ATTR"
            yield from walk(child, scope)

    yield from walk(tree, "<module>")


def _found(root: Path) -> Set[Tuple[str, str, str]]:
    return {
        (path.relative_to(root).as_posix(), scope, what)
        for path in sorted(root.rglob("*.py"))
        for scope, what in _sites(ast.parse(path.read_text(), str(path)))
    }


def test_only_listed_functions_read_the_mode() -> None:
    readers = {(module, scope) for module, scope, what in _found(LINE) if what == "cp_mode"}
    new = sorted(readers - set(MODE_READERS))
    assert not new, (
        f"new readers of the mode in v0_5_23/: {new}. A per-call hook asks whether the cache "
        "has a CpCacheExtension (extension_of); startup code reads cp_mode once (list it "
        "in MODE_READERS with when it runs)"
    )
    assert not sorted(set(MODE_READERS) - readers), "remove the readers that are gone"


def test_the_mode_attribute_is_named_only_by_its_reader_and_writers() -> None:
    sites = {(module, scope) for module, scope, what in _found(LINE) if what == "MODE_ATTR"}
    assert sites == MODE_ATTR_SITES, sorted(sites ^ MODE_ATTR_SITES)


def test_no_retired_predicate_is_defined() -> None:
    for root in (LINE, PACKAGE / "testing" / "v0_5_23"):
        defined = sorted(s for s in _found(root) if s[2].startswith("def "))
        assert not defined, f"a retired per-call mode predicate is back: {defined}"


def test_the_mode_is_three_frozen_values() -> None:
    assert [m.value for m in CpMode] == ["off", "sharded", "one_rank_l3_reader"]
    assert [m.shards_kv for m in CpMode] == [False, True, False]
    assert [m.owner_free_storage for m in CpMode] == [False, True, True]


def test_the_scan_sees_a_planted_predicate(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def cp_shared_kv_enabled(server_args):\n"
        "    return cp_mode(server_args).shards_kv\n"
        "def lane_aware(cache):\n"
        "    return getattr(get_server_args(), MODE_ATTR, None) is not None\n"
        "def on_extend(cache):\n"
        f"    return getattr(cache.server_args, {MODE_ATTR!r}, None)\n"
    )
    assert sorted(_found(tmp_path)) == [
        ("planted.py", "<module>", "def cp_shared_kv_enabled"),
        ("planted.py", "cp_shared_kv_enabled", "cp_mode"),
        ("planted.py", "lane_aware", "MODE_ATTR"),
        ("planted.py", "on_extend", "MODE_ATTR"),
    ]
