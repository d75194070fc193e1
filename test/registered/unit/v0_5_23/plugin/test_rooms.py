"""The 0.5.23 line's rooms (``docs/architecture.md``): each feature a package that exports
its hook specs, ``hooks.py`` joining them, and rooms importing each other only along the
documented arrows. Read from the source (``ast``), nothing of the rooms imported."""

import ast
from pathlib import Path
from typing import Dict, Set, Tuple

import sglang_cp_hicache.v0_5_23 as line
from sglang_cp_hicache.v0_5_23 import admission, backup, cache, eviction, hooks, launch, selftest, storage

LINE = Path(line.__file__).parent
PREFIX = "sglang_cp_hicache.v0_5_23."
ROOMS = ("launch", "cache", "eviction", "selftest", "storage", "backup", "admission")

# (importer room, imported room): why the arrow exists.
ALLOWED: Dict[Tuple[str, str], str] = {
    ("cache", "launch"): "the mode the extension is built under",
    ("cache", "backup"): "hicache_init sets up the per-layer backup once HiCache exists",
    ("eviction", "cache"): "the tiers' state and stats live on the extension",
    ("selftest", "launch"): "the mode decides whether a runner self-tests",
    ("storage", "launch"): "the mode and the flag's name in refusals",
    ("storage", "cache"): "the extension: start owners, anchor skips, host side",
    ("storage", "eviction"): "host room for a storage hit (room_for_backup)",
    ("backup", "cache"): "the extension carries the per-layer backup",
    ("backup", "eviction"): "host room for the per-layer reservation and upstream's backup (room_for_backup, backup_with_lane_room)",
    ("admission", "launch"): "the mode, read once per tokenizer manager, and the flag's name",
}


def room_imports(source: str) -> Set[str]:
    """The rooms of this line that ``source`` imports (module level or in a function)."""
    found: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith(PREFIX):
                head = name[len(PREFIX):].split(".")[0]
                if head in ROOMS:
                    found.add(head)
    return found


def room_arrows() -> Dict[Tuple[str, str], Set[str]]:
    """(importer room, imported room) -> the importing files."""
    arrows: Dict[Tuple[str, str], Set[str]] = {}
    for room in ROOMS:
        for path in sorted((LINE / room).glob("*.py")):
            for target in room_imports(path.read_text()) - {room}:
                arrows.setdefault((room, target), set()).add(f"{room}/{path.name}")
    return arrows


def test_rooms_import_each_other_only_along_the_documented_arrows():
    arrows = room_arrows()
    assert ("backup", "cache") in arrows  # the scan is real
    unexpected = {arrow: sorted(files) for arrow, files in arrows.items() if arrow not in ALLOWED}
    assert unexpected == {}


def test_no_room_imports_the_line_s_hook_table():
    """``hooks.py`` joins the rooms; a room reaches the line's check through the plugin's
    entry point (``plugin.verify_installed``), never by importing the table upward."""
    upward = sorted(
        f"{room}/{path.name}"
        for room in ROOMS
        for path in sorted((LINE / room).glob("*.py"))
        if f"{PREFIX}hooks" in _imported_names(path.read_text())
    )
    assert upward == []


def _imported_names(source: str) -> Set[str]:
    names: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_the_upward_scan_sees_a_planted_import():
    assert f"{PREFIX}hooks" in _imported_names(f"from {PREFIX}hooks import verify_hooks_installed\n")
    assert f"{PREFIX}hooks" in _imported_names("from sglang_cp_hicache.v0_5_23 import hooks\n")


def test_the_scan_finds_a_planted_arrow():
    planted = "def f():\n    from sglang_cp_hicache.v0_5_23.storage import owner_io\n"
    assert room_imports(planted) == {"storage"}


def test_the_line_table_is_the_rooms_tables_joined():
    rooms = (launch, cache, eviction, selftest, storage, backup, admission)
    assert hooks.HOOKS == tuple(spec for room in rooms for spec in room.HOOKS)
    assert hooks.RESOLUTION_STEPS == launch.RESOLUTION_STEPS
    for room, module in zip(ROOMS, rooms):
        own = f"{PREFIX}{room}."
        assert module.HOOKS and all(spec.hook.startswith(own) for spec in module.HOOKS), room


def test_every_module_of_the_line_is_in_a_room():
    loose = sorted(p.name for p in LINE.glob("*.py"))
    assert loose == ["__init__.py", "hooks.py", "resolution_steps.py"]
    assert sorted(p.name for p in LINE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ROOMS)
