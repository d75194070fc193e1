"""Upstream 0.5.23's L3 under unsharded prefill CP with an MLA model never reads back: the file
backend keys every page by CP rank (``_cp<rank>_<size>``, "each CP rank holds a disjoint slice
of every page"), while the MLA writer rule lets only TP rank 0 write (``is_storage_writer``:
``tp_rank == dcp_rank``). At tp 2 = cp 2, CP rank 1 is TP rank 1: it never writes its pages, so
its lookups miss and the prefetch's MIN over the ranks is 0 on every request (seen in the
serving harness: 20 files written, no storage hit after a flush).

The harness works around it for its unsharded CP prefills only (the runtime step
``testing/v0_5_23/server_runtime.py:_unsharded_cp_l3_writers``, the plugin's own writer rule
for sharded prefills, ``storage/owner_io.py``). This test pins upstream's behaviour: when it
fails, upstream has changed the rule, and the workaround and ``docs/serving_on_cpu.md`` go."""

from __future__ import annotations

import torch


def _config(tp_rank: int, cp_rank: int, cp_size: int = 2):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=cp_rank, attn_cp_size=cp_size,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="m", extra_config=None,
    )  # fmt: skip


def _file_backend(tmp_path, config):
    import dataclasses

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(dataclasses.replace(config, extra_config={"file_storage_path": str(tmp_path)}))


PAGE = torch.full((64,), 7, dtype=torch.bfloat16)


def test_cp_rank_1_reads_keys_no_rank_writes(tmp_path):
    rank0_config, rank1_config = _config(tp_rank=0, cp_rank=0), _config(tp_rank=1, cp_rank=1)
    assert rank0_config.is_storage_writer and not rank1_config.is_storage_writer
    rank0, rank1 = _file_backend(tmp_path, rank0_config), _file_backend(tmp_path, rank1_config)
    assert rank0.set("abc", PAGE) and rank0.exists("abc")
    assert not rank1.exists("abc"), "CP rank 1 found a page only CP rank 0 writes: upstream changed its keys"


def test_the_harness_step_makes_every_cp_rank_a_writer_of_its_own_pages(tmp_path, monkeypatch):
    """``writers_within_attention_tp`` (the reference's step): CP rank 1 (attention TP rank 0
    of 1) writes and then finds its pages; without CP the config is upstream's."""
    import types

    import sglang.srt.runtime_context as runtime_context

    from sglang_cp_hicache.testing.v0_5_23.server_runtime import writers_within_attention_tp

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(attn_tp_rank=0, attn_tp_size=1))
    generate = writers_within_attention_tp(lambda controller, cp_rank, cp_size: _config(1, cp_rank, cp_size))
    config = generate(None, 1, 2)
    assert config.is_storage_writer and (config.attn_cp_rank, config.attn_cp_size) == (1, 2)
    rank1 = _file_backend(tmp_path, config)
    assert rank1.set("abc", PAGE) and rank1.exists("abc")
    assert generate(None, 0, 1) == _config(1, 0, 1)  # no CP: untouched
