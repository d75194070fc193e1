"""``FieldOverlay``: the one view the plugin shows upstream's code (the gate's record views,
the attach's refusal record, the self-test's runner): named fields shown, the rest live,
nothing writable."""

from types import SimpleNamespace

import pytest

from sglang_cp_hicache.core.field_overlay import FieldOverlay, constant


def test_named_fields_are_shown_and_the_rest_is_read_live():
    record = SimpleNamespace(hicache_storage_backend="mooncake", page_size=64)
    view = FieldOverlay(record, {"hicache_storage_backend": constant(None)})
    assert view.hicache_storage_backend is None and view.page_size == 64
    record.page_size = 1  # a later resolution step's value shows through
    assert view.page_size == 1
    assert record.hicache_storage_backend == "mooncake"  # the real record is untouched


def test_a_shown_field_is_a_function_of_the_real_value():
    record = SimpleNamespace(hicache_storage_backend="nixl")
    view = FieldOverlay(record, {"hicache_storage_backend": lambda b: None if b == "file" else b})
    assert view.hicache_storage_backend == "nixl"
    record.hicache_storage_backend = "file"
    assert view.hicache_storage_backend is None


def test_a_missing_field_raises_as_on_the_base_unless_the_view_shows_it():
    view = FieldOverlay(SimpleNamespace(), {"pool": constant("self-test pool")})
    assert view.pool == "self-test pool"
    with pytest.raises(AttributeError):
        view.missing


def test_writes_raise_naming_the_base_and_the_field():
    view = FieldOverlay(SimpleNamespace(a=1), {"a": constant(2)})
    with pytest.raises(AttributeError, match="SimpleNamespace.*'a'"):
        view.a = 3
