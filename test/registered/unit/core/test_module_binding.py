"""core.module_binding: one module's binding swapped for a block, restored raising or not,
other modules' bindings of the same function untouched."""

from __future__ import annotations

import types

import pytest

from sglang_cp_hicache.core.module_binding import binding_swapped


def _shared(x: int) -> int:
    return x


def _modules() -> tuple:
    caller, other = types.ModuleType("caller"), types.ModuleType("other")
    caller.shared = other.shared = _shared
    return caller, other


def test_within_the_block_only_the_callers_binding_is_the_replacement() -> None:
    caller, other = _modules()
    with binding_swapped(caller, "shared", lambda original: lambda x: original(x) + 1):
        assert caller.shared(1) == 2 and other.shared(1) == 1
    assert caller.shared is _shared and other.shared is _shared


def test_the_binding_is_restored_when_the_block_raises() -> None:
    caller, _ = _modules()
    with pytest.raises(RuntimeError, match="refused"):
        with binding_swapped(caller, "shared", lambda original: lambda x: -x):
            assert caller.shared(3) == -3
            raise RuntimeError("refused")
    assert caller.shared is _shared


def test_a_missing_name_is_an_error_before_anything_changes() -> None:
    caller, _ = _modules()
    with pytest.raises(AttributeError):
        with binding_swapped(caller, "absent", lambda original: original):
            pass
    assert not hasattr(caller, "absent")
