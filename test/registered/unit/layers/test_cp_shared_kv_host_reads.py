"""Device->host reads per shared-KV prefill forward and at admission, counted on CPU.

The forward batch's GPU-resident tensors are :class:`DeviceOnly` stand-ins (a host read
of one is recorded, on a GPU it would be a sync); SGLang's ``*_cpu`` fields stay plain.
Pinned: the forward state build reads the device exactly once, the batch's page-start
column of ``req_to_token`` (``read_request_logical_pages``, see docs/attention_runtime.md,
*Not covered*), and nothing else does.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.testing.host_reads import HostRead, device_only, recording_host_reads

PAGE = 64
PAGE_COLUMN_READ = "sglang_cp_hicache.layers.attention.cp_shared_kv_mapping:read_request_logical_pages"


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


def test_the_forward_reads_the_device_once_for_the_page_column():
    from sglang_cp_hicache.layers.attention.cp_shared_kv_budget import DenseBufferBudget

    layout = CpSharedKVLayout(2, 1, PAGE)
    budget = DenseBufferBudget(max_prefix_tokens=8 * PAGE, bytes_per_token=788, page_size=PAGE, cp_size=2)
    backend = SimpleNamespace(forward_metadata=None)
    setattr(backend, hooks.RUNTIME_ATTR, hooks.CpSharedKVRuntime(layout, None, "all_gather", False, budget=budget))
    batch, page_table = _extend_batch()

    def upstream_metadata(self, forward_batch):
        self.forward_metadata = _metadata(page_table)

    with recording_host_reads() as reads:
        hooks.init_forward_metadata_around(upstream_metadata, backend, batch)
    state = getattr(batch, hooks.STATE_ATTR)
    assert reads == [PAGE_COLUMN_READ]
    assert state.mapping.plan.owner_logical_pages[1].tolist() == [5]  # the prefix page rank 1 owns
    assert state.mapping.num_dense_pages == 1 + 4
