"""Device->host reads per shared-KV prefill forward and at admission, counted on CPU.

The forward batch's GPU-resident tensors are :class:`DeviceOnly` stand-ins (a host read
of one is recorded, on a GPU it would be a sync); SGLang's ``*_cpu`` fields stay plain.
Pinned: a forward made on the scheduler path (SGLang's ``alloc_for_extend``,
``get_model_worker_batch``, ``ForwardBatch.init_new`` with the plugin's hooks) reads the
device not once: its logical pages come with it from the req_to_token host mirror. A
forward batch without them reads exactly the batch's page-start column of ``req_to_token``
(``read_request_logical_pages``), warned once, and nothing else (docs/attention_runtime.md).
"""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_mapping as mapping_module
from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import (
    build_batch_mapping,
    read_request_logical_pages,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack, scheduler_batch
from sglang_cp_hicache.testing.host_reads import HostRead, device_only, recording_host_reads

PAGE = 64
PAGE_COLUMN_READ = "sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping:read_request_logical_pages"


def test_the_stand_in_notices_host_reads_through_torch_ops():
    locs = device_only(torch.arange(8))
    derived = (locs * 2)[torch.tensor([1, 2])].to(torch.int32)
    with pytest.raises(HostRead, match="tolist"):
        derived.tolist()
    with recording_host_reads() as reads:
        derived.cpu()
        int(derived[0])
        derived.to("cpu")
        bool((derived > 0).all())
    assert len(reads) == 4


def _metadata(page_table):
    from sglang.srt.layers.attention.nsa_backend import NSAMetadata

    zeros = device_only(torch.zeros(2, dtype=torch.int32))
    return NSAMetadata(
        page_size=PAGE, cache_seqlens_int32=zeros, max_seq_len_q=1, max_seq_len_k=page_table.shape[1],
        cu_seqlens_q=zeros, cu_seqlens_k=zeros, page_table_1=page_table,
        real_page_table=page_table[:, ::PAGE] // PAGE, nsa_cache_seqlens_int32=zeros,
        nsa_cu_seqlens_q=zeros, nsa_cu_seqlens_k=zeros, nsa_extend_seq_lens_list=[1, 1],
        nsa_seqlens_expanded=zeros, page_table_1_flattened=None,
    )


def _extend_batch():
    """Two requests: 3 pages (2 cached) and 1 page; rows 0 and 1 of ``req_to_token``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    req_to_token = torch.zeros(4, 4 * PAGE, dtype=torch.int32)
    for row, pages in ((0, [5, 8, 3]), (1, [6])):
        for i, page in enumerate(pages):
            req_to_token[row, i * PAGE : (i + 1) * PAGE] = torch.arange(page * PAGE, (page + 1) * PAGE)
    seq_lens_cpu, prefix_lens_cpu = torch.tensor([3 * PAGE, 10]), [2 * PAGE, 0]
    out_cache_loc = torch.cat([req_to_token[0, 2 * PAGE : 3 * PAGE], req_to_token[1, :10]]).long()
    rows = torch.tensor([0, 1])
    return SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=2,
        req_to_token_pool=SimpleNamespace(req_to_token=device_only(req_to_token)),
        req_pool_indices=device_only(rows), seq_lens=device_only(seq_lens_cpu.clone()),
        seq_lens_cpu=seq_lens_cpu, extend_prefix_lens_cpu=prefix_lens_cpu,
        extend_seq_lens_cpu=[PAGE, 10], out_cache_loc=device_only(out_cache_loc),
        token_to_kv_pool=SimpleNamespace(size=32 * PAGE, page_size=PAGE),
    ), device_only(req_to_token[rows, : 3 * PAGE])


def _backend(layout: CpSharedKVLayout, budget=None):
    backend = SimpleNamespace(forward_metadata=None)
    setattr(backend, hooks.RUNTIME_ATTR, hooks.CpSharedKVRuntime(layout, None, "all_gather", False, budget=budget))
    return backend


def _upstream_metadata(page_table):
    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = _metadata(page_table)

    return init_forward_metadata


def test_without_carried_pages_the_forward_reads_the_page_column_once_and_warns_once(monkeypatch, caplog):
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import DenseBufferBudget

    monkeypatch.setattr(mapping_module, "_warned_page_column_read", False)
    layout = CpSharedKVLayout(2, 1, PAGE)
    budget = DenseBufferBudget(max_prefix_tokens=8 * PAGE, bytes_per_token=788, page_size=PAGE, cp_size=2)
    backend = _backend(layout, budget)
    with caplog.at_level(logging.WARNING, logger=mapping_module.__name__):
        for _ in range(2):
            batch, page_table = _extend_batch()
            with recording_host_reads() as reads:
                hooks.init_forward_metadata_around(_upstream_metadata(page_table), backend, batch)
            assert reads == [PAGE_COLUMN_READ]
    warnings = [r for r in caplog.records if "carries no host snapshot" in r.getMessage()]
    assert len(warnings) == 1 and "CP HiRadixCache" in warnings[0].getMessage()
    state = getattr(batch, hooks.STATE_ATTR)
    assert state.mapping.plan.owner_logical_pages[1].tolist() == [5]  # the prefix page rank 1 owns
    assert state.mapping.num_dense_pages == 1 + 4


# ---------------------------------------------------------------- the scheduler path
@pytest.fixture
def stack(gloo_world1, plugins_loaded):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PAGE * 16, req_pool_size=8, max_context_len=8 * PAGE)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    assert isinstance(stack.cache, CpHiRadixCache) and stack.cache.req_loc_mirror is not None
    with scheduler_batch.cpu_scheduler_server_args(PAGE):
        yield stack
    stack.close()


def _req(rid: str, ids) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=1))


def _cached_prompt(stack, ids) -> None:
    """``ids`` prefilled in one batch and cached in the tree (device)."""
    req = _req("cached", ids)
    req.init_next_round_input(stack.cache)
    scheduler_batch.extend_batch(stack, [req], [len(ids)])
    req.kv_committed_len = req.kv_allocated_len = len(ids)
    release_kv_cache(req, stack.cache)


def test_the_scheduler_path_forward_reads_nothing_back(stack, monkeypatch):
    monkeypatch.setattr(mapping_module, "_warned_page_column_read", False)
    shared = list(range(1, 1 + 3 * PAGE + 9))
    _cached_prompt(stack, shared)
    # A request hitting 3 cached pages (its 4th page holds new tokens only), one hitting none.
    hit, miss = _req("hit", shared[: 3 * PAGE] + [7] * (PAGE + 5)), _req("miss", range(9000, 9000 + 2 * PAGE + 3))
    for req in (hit, miss):
        req.init_next_round_input(stack.cache)
    assert len(hit.prefix_indices) == 3 * PAGE and len(miss.prefix_indices) == 0
    seq_lens = [len(hit.origin_input_ids), len(miss.origin_input_ids)]
    forward_batch = scheduler_batch.forward_batch(stack, scheduler_batch.extend_batch(stack, [hit, miss], seq_lens))

    rows = stack.req_to_token_pool.req_to_token
    slots = forward_batch.req_pool_indices
    forward_batch.req_to_token_pool = SimpleNamespace(req_to_token=device_only(rows))
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
        setattr(forward_batch, name, device_only(getattr(forward_batch, name)))
    page_table = device_only(rows[slots, : max(seq_lens)])
    backend = _backend(stack.layout)
    with recording_host_reads() as reads:
        hooks.init_forward_metadata_around(_upstream_metadata(page_table), backend, forward_batch)
    assert reads == []
    assert not mapping_module._warned_page_column_read

    state = getattr(forward_batch, hooks.STATE_ATTR)
    expected = build_batch_mapping(
        stack.layout, read_request_logical_pages(rows, slots, seq_lens, PAGE), [3 * PAGE, 0], "cpu"
    )
    assert torch.equal(state.mapping.sorted_logical_pages, expected.sorted_logical_pages)
    assert torch.equal(state.mapping.dense_of_sorted, expected.dense_of_sorted)
    assert [p.tolist() for p in state.mapping.plan.owner_logical_pages] == [
        p.tolist() for p in expected.plan.owner_logical_pages
    ]
    assert state.mapping.plan.num_prefix_pages == 3 and state.mapping.num_dense_pages == 1 + 3 + 2 + 3
