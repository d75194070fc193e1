"""Upstream 0.5.23's L3 under unsharded prefill CP with an MLA model never reads back: the file
backend keys every page by CP rank (``_cp<rank>_<size>``, "each CP rank holds a disjoint slice
of every page"), while the MLA writer rule lets only TP rank 0 write (``is_storage_writer``:
``tp_rank == dcp_rank``). At tp 2 = cp 2, CP rank 1 is TP rank 1: it never writes its pages, so
its lookups miss and the prefetch's MIN over the ranks is 0 on every request (seen in the
serving harness: 20 files written, no storage hit after a flush).

The harness works around it for its unsharded CP prefills only (the runtime step
``testing/v0_5_23/server_runtime.py:_unsharded_cp_l3_writers``, the plugin's own writer rule
for sharded prefills, ``storage/owner_io.py``), in the processes it starts with
``UNSHARDED_CP_L3_WRITERS_ENV``. These tests run upstream's own
``HiCacheController._generate_storage_config`` (the function the step wraps) and file backend:
when the first fails, upstream has changed its rule, and the workaround and
``docs/serving_on_cpu.md`` go."""

from __future__ import annotations

import types

import pytest
import torch

from sglang_cp_hicache.testing.server.launch import UNSHARDED_CP_L3_WRITERS_ENV, PrefillSpec, StorageSpec
from sglang_cp_hicache.testing.v0_5_23 import server_runtime

PAGE = torch.full((64,), 7, dtype=torch.bfloat16)
STEP_NAME = "unsharded CP prefill's L3"


def _parallel(tp_rank: int) -> types.SimpleNamespace:
    """An unsharded tp 2 = cp 2 prefill's rank: attention TP 1 within each CP rank."""
    return types.SimpleNamespace(tp_rank=tp_rank, tp_size=2, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0,
                                 pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)  # fmt: skip


def _controller(cp_rank: int, cp_size: int = 2) -> types.SimpleNamespace:
    """What ``_generate_storage_config`` reads of an unsharded HiCacheController: an MLA device
    pool, a layer-first host pool, its CP rank and size (``is_kv_sharded`` for the plugin's
    own writer hook, which wraps the function once plugins are loaded and leaves an unsharded
    controller's config as upstream makes it)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return types.SimpleNamespace(
        is_kv_sharded=False,
        mem_pool_device=MLATokenToKVPool.__new__(MLATokenToKVPool),
        mem_pool_host=types.SimpleNamespace(layout="layer_first"),
        storage_host_pool=types.SimpleNamespace(storage_format_tag=None),
        get_attn_cp_rank_and_size=lambda: (cp_rank, cp_size),
        enable_storage_metrics=False,
        page_size=64,
    )


@pytest.fixture
def storage_config(monkeypatch, tmp_path):
    """``storage_config(rank, generate)``: the storage config ``generate`` (upstream's
    ``_generate_storage_config``, wrapped or not) makes on CP rank ``rank`` (= TP rank), whose
    pages go to ``tmp_path``."""
    import sglang.srt.managers.cache_controller as cache_controller
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(cache_controller, "is_dp_attention_enabled", lambda: False)

    def make(rank: int, generate=None, cp_size: int = 2):
        generate = generate or cache_controller.HiCacheController._generate_storage_config
        for module in (cache_controller, runtime_context):
            monkeypatch.setattr(module, "get_parallel", lambda: _parallel(rank))
        return generate(_controller(rank, cp_size), "m", {"file_storage_path": str(tmp_path)})

    return make


def _file_backend(config):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(config)


def test_upstream_cp_rank_1_reads_keys_no_rank_writes(storage_config):
    rank0_config, rank1_config = storage_config(0), storage_config(1)
    assert (rank1_config.attn_cp_rank, rank1_config.tp_rank) == (1, 1)
    assert rank0_config.is_storage_writer, "upstream's CP rank 0 no longer writes"
    assert not rank1_config.is_storage_writer, "upstream's CP rank 1 writes now: the harness step can go"
    rank0, rank1 = _file_backend(rank0_config), _file_backend(rank1_config)
    assert rank0.set("abc", PAGE) and rank0.exists("abc")
    assert not rank1.exists("abc"), "CP rank 1 found a page only CP rank 0 writes: upstream changed its keys"


def test_the_harness_step_makes_every_cp_rank_a_writer_of_its_own_pages(storage_config):
    """``writers_within_attention_tp`` over upstream's own function: CP rank 1 writes and then
    finds its pages; without CP the config is upstream's."""
    from sglang.srt.managers.cache_controller import HiCacheController

    wrapped = server_runtime.writers_within_attention_tp(HiCacheController._generate_storage_config)
    config = storage_config(1, wrapped)
    assert config.is_storage_writer and (config.attn_cp_rank, config.attn_cp_size) == (1, 2)
    rank1 = _file_backend(config)
    assert rank1.set("abc", PAGE) and rank1.exists("abc")
    assert storage_config(1, wrapped, cp_size=1) == storage_config(1, cp_size=1)  # no CP: untouched


def test_only_the_harness_unsharded_cp_prefills_with_l3_get_the_step(monkeypatch, tmp_path):
    """The step is gated: the environment marks only an unsharded CP prefill with an L3 tier,
    and the runtime adds (and so names in its log line) the step only where it is marked."""
    tier = StorageSpec("file", directory=tmp_path)
    marked = {
        (sharded, tp, storage is not None): UNSHARDED_CP_L3_WRITERS_ENV in PrefillSpec("p", tp, sharded, storage=storage).env()
        for sharded in (True, False) for tp in (1, 2) for storage in (None, tier)
    }  # fmt: skip
    assert [key for key, yes in marked.items() if yes] == [(False, 2, True)]
    for value, expected in (("1", 1), ("0", 0), (None, 0)):
        if value is None:
            monkeypatch.delenv(UNSHARDED_CP_L3_WRITERS_ENV, raising=False)
        else:
            monkeypatch.setenv(UNSHARDED_CP_L3_WRITERS_ENV, value)
        assert sum(step.name.startswith(STEP_NAME) for step in server_runtime.steps()) == expected
