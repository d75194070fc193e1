"""The attention package keeps the serving guard importable and closed."""

import pytest

import sglang_cp_hicache.layers.attention as attention


def test_guard_is_importable_and_still_closed():
    from sglang_cp_hicache.layers.attention import (  # noqa: F401
        SHARED_KV_READ_PATH_AVAILABLE,
        SharedKVReadPathMissing,
        require_shared_kv_read_path,
    )

    assert attention.SHARED_KV_READ_PATH_AVAILABLE is False
    with pytest.raises(attention.SharedKVReadPathMissing):
        attention.require_shared_kv_read_path()
