"""The owner-free file backend (``v0_5_23.storage.file_backend``) and the backend
choice under the flag (``v0_5_23.storage.backend_factory``), in one process."""

from __future__ import annotations

import os

import pytest
import torch

from sglang_cp_hicache.core.storage_keys import StorageNamespace


def make_namespace(**changes) -> StorageNamespace:
    fields = dict(model="m", kv_dtype="torch.bfloat16", kv_cache_dim=576, layer_num=2,
                  host_layout="layer_first", page_size=64)  # fmt: skip
    fields.update(changes)
    return StorageNamespace(**fields)


@pytest.fixture
def make_backend(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from sglang_cp_hicache.v0_5_23.storage.file_backend import OwnerFreeHiCacheFile

    def build(rank: int = 0, cp: int = 2, **namespace):
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=rank, attn_cp_size=cp,
            is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="m", extra_config={"file_storage_path": str(tmp_path)},
        )  # fmt: skip
        return OwnerFreeHiCacheFile(config, make_namespace(**namespace))

    return build


def page(fill: int, n: int = 64) -> torch.Tensor:
    return torch.full((n,), fill, dtype=torch.bfloat16)


def test_a_page_written_by_one_rank_reads_back_on_another_cp_size(make_backend, tmp_path):
    writer, reader = make_backend(rank=1, cp=2), make_backend(rank=3, cp=4)
    assert writer.set("abc", page(7))
    assert writer.set("abc.indexer", page(9))
    out = torch.zeros(64, dtype=torch.bfloat16)
    assert reader.get("abc", out) is not None and torch.equal(out, page(7))
    assert reader.get("abc.indexer", out) is not None and torch.equal(out, page(9))
    names = sorted(os.listdir(tmp_path))
    assert names == sorted(make_namespace().object_key(c, "abc") + ".bin" for c in ("kv", "indexer"))


def test_another_namespace_misses(make_backend):
    make_backend().set("abc", page(7))
    other = make_backend(host_layout="page_first")
    assert not other.exists("abc")
    assert other.get("abc", torch.zeros(64, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("size", [32, 96])
def test_a_file_of_the_wrong_size_is_a_counted_miss(make_backend, size):
    backend = make_backend()
    backend.set("abc", page(7, size))  # torn (short) or another format (longer)
    out = torch.zeros(64, dtype=torch.bfloat16)
    assert backend.get("abc", out) is None
    assert backend.rejected_reads == 1
    assert torch.equal(out, torch.zeros(64, dtype=torch.bfloat16)), "no byte was taken"


def test_an_absent_page_is_a_plain_miss(make_backend):
    backend = make_backend()
    assert backend.get("nope", torch.zeros(64, dtype=torch.bfloat16)) is None
    assert backend.rejected_reads == 0


def test_other_backends_are_refused_with_the_flag_named():
    from sglang_cp_hicache.v0_5_23.storage.backend_factory import (
        UnsupportedShardedStorageError,
        refuse_unless_owner_free,
    )
    from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

    refuse_unless_owner_free("file")
    refuse_unless_owner_free("mooncake")
    with pytest.raises(UnsupportedShardedStorageError, match=f"^{CLI_FLAG}: .*hf3fs"):
        refuse_unless_owner_free("hf3fs")


@pytest.mark.parametrize("flag", [False, True], ids=["flag_off", "flag_on"])
def test_the_factory_follows_the_flag_on_an_unsharded_host_pool(monkeypatch, flag):
    """Flag off: upstream's factory. Flag on: the owner-free choice even on an unsharded
    host pool (one prefill rank reading a sharded fleet's pages), so hf3fs is refused."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_hicache.v0_5_23.storage.backend_factory import (
        UnsupportedShardedStorageError,
        create_backend_around,
    )
    from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

    record = ServerArgs(model_path="dummy")
    set_cp_shared_kv_enabled(record, flag)
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: record)
    calls = []

    def upstream(factory, name, config, pool, **kwargs):
        calls.append(name)
        return "upstream"

    pool = torch.zeros(1)  # any host pool that is not a PageInterleaveHostPool
    if flag:
        with pytest.raises(UnsupportedShardedStorageError, match="hf3fs"):
            create_backend_around(upstream, object, "hf3fs", None, pool)
        assert calls == []
    else:
        assert create_backend_around(upstream, object, "hf3fs", None, pool) == "upstream"
        assert calls == ["hf3fs"]
