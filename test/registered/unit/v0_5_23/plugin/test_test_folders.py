"""The 0.5.23 line's tests mirror its rooms (``docs/architecture.md``): every product room
has its folder under ``unit/v0_5_23/``, and no test folder of the line (unit or multi-rank)
names a room that does not exist. The few folders that are not rooms are listed below, each
with why. Reads the two trees' folder names, imports nothing of the rooms."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Set

import sglang_cp_hicache.v0_5_23 as line

LINE = Path(line.__file__).parent
TESTS = Path(__file__).resolve().parents[3]  # test/registered
UNIT = TESTS / "unit" / "v0_5_23"
MULTI_RANK = TESTS / "multi_rank" / "v0_5_23"

# Test folders that are no room of the line -> why they exist.
NOT_ROOMS: Dict[str, str] = {
    "plugin": "the line as a whole: registration, its hook table and the ratchets that read every room's source",
    "native": "upstream's native sharding (read path, sharded stack, PD transfer) proven on CPU ranks; no room of ours owns it",
    "sim": "the simulator (sim/), a tool beside the product",
    "testing": "the CPU runtime and harnesses (testing/)",
    "scripts": "scripts/ and benchmark/",
}


def product_rooms() -> Set[str]:
    """The line's rooms: its packages (a folder with an ``__init__.py``)."""
    return {p.name for p in LINE.iterdir() if (p / "__init__.py").is_file()}


def folders(root: Path) -> Set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}


def folder_problems(rooms: Set[str], unit: Set[str], multi_rank: Set[str]) -> List[str]:
    """What is wrong with the test folders ``unit`` and ``multi_rank`` for ``rooms``."""
    problems = [f"room {room} has no unit test folder" for room in sorted(rooms - unit)]
    for kind, found in (("unit", unit), ("multi_rank", multi_rank)):
        problems += [
            f"{kind} folder {name} is neither a room nor listed in NOT_ROOMS"
            for name in sorted(found - rooms - set(NOT_ROOMS))
        ]
    problems += [f"NOT_ROOMS lists {name}, a room" for name in sorted(rooms & set(NOT_ROOMS))]
    problems += [
        f"NOT_ROOMS lists {name}, a folder neither tree has"
        for name in sorted(set(NOT_ROOMS) - unit - multi_rank)
    ]
    return problems


def test_every_room_has_its_test_folder_and_every_test_folder_is_a_room_or_listed() -> None:
    rooms = product_rooms()
    assert {"launch", "cache", "eviction"} <= rooms  # the scan is real
    assert folder_problems(rooms, folders(UNIT), folders(MULTI_RANK)) == []


def test_each_rooms_unit_folder_holds_tests() -> None:
    empty = [room for room in sorted(product_rooms()) if not list((UNIT / room).glob("test_*.py"))]
    assert empty == []


def test_no_test_file_sits_loose_beside_the_folders() -> None:
    assert sorted(p.name for p in UNIT.glob("*.py")) == []
    assert sorted(p.name for p in MULTI_RANK.glob("*.py")) == []


def test_the_check_names_a_missing_room_an_unknown_folder_and_a_stale_listing() -> None:
    rooms = {"launch", "cache"}
    unit = {"launch", "mem_cache", "plugin", "native", "sim", "testing", "scripts"}
    assert folder_problems(rooms, unit, {"launch"}) == [
        "room cache has no unit test folder",
        "unit folder mem_cache is neither a room nor listed in NOT_ROOMS",
    ]
    assert folder_problems(rooms, {"launch", "cache"}, set()) == [
        f"NOT_ROOMS lists {name}, a folder neither tree has" for name in sorted(NOT_ROOMS)
    ]
