"""PD transfer under shared KV: every page sent once, by its owner, to the right slot."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.v0_5_12.disaggregation.mooncake.conn import (
    filter_nsa_state_indices,
    maybe_send_extra_around,
    owned_state_pages,
)
from sglang_cp_hicache.v0_5_12.disaggregation.utils import (
    filter_kv_indices_for_cp_rank_around,
    filter_kv_indices_for_shared_kv,
    owned_pages_for_transfer,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

PAGE = 64


def _request_pages(cp_size, num_pages, seed):
    rng = np.random.default_rng(seed)
    return (rng.permutation(200 * cp_size)[:num_pages] + cp_size).astype(np.int32)


def _simulate_sender(layout, logical_pages, chunk_sizes):
    """Mirror MooncakeKVSender.send: chunks advance curr_idx; the filter picks pages."""
    sent, curr = [], 0
    for size in chunk_sizes:
        chunk = logical_pages[curr : curr + size]
        src, dst = filter_kv_indices_for_shared_kv(layout, chunk, slice(curr, curr + size))
        sent.append((src, dst))
        curr += size
    return sent


@pytest.mark.parametrize("cp_size", [2, 4, 8])
@pytest.mark.parametrize("chunk_sizes", [(37,), (16, 16, 5), (1,) * 9 + (28,)])
def test_every_page_sent_exactly_once_by_its_owner_to_its_slot(cp_size, chunk_sizes):
    logical = _request_pages(cp_size, sum(chunk_sizes), seed=cp_size)
    decode_pages = np.arange(1000, 1000 + len(logical))  # decode's destination page list
    received = {}
    for rank in range(cp_size):
        layout = CpSharedKVLayout(cp_size, rank, PAGE)
        for src, dst in _simulate_sender(layout, logical, chunk_sizes):
            assert src.dtype == logical.dtype
            assert len(src) == len(dst)
            for physical, position in zip(src.tolist(), dst.tolist()):
                dst_page = int(decode_pages[position])  # what Mooncake indexes
                assert dst_page not in received, "page sent twice"
                source_logical = physical * cp_size + rank
                received[dst_page] = (rank, source_logical)
    assert len(received) == len(logical)
    for position, logical_page in enumerate(logical.tolist()):
        rank, source_logical = received[int(decode_pages[position])]
        assert rank == lane_of(logical_page, cp_size) and source_logical == logical_page


def test_positions_are_absolute_in_the_request_and_index_the_decode_list():
    layout = CpSharedKVLayout(2, 1, PAGE)
    share = owned_pages_for_transfer(layout, np.array([5, 6, 7, 9]), first_position=10)
    assert share.physical_pages.tolist() == [2, 3, 4]
    assert share.dst_positions.tolist() == [10, 12, 13]
    dst_kv_indices = np.arange(100, 120)
    assert dst_kv_indices[share.dst_positions].tolist() == [110, 112, 113]


def _kv_mgr(enabled, cp_rank=1, cp_size=2):
    return SimpleNamespace(
        server_args=SimpleNamespace(enable_nsa_prefill_cp_shared_kv=enabled),
        attn_cp_rank=cp_rank,
        attn_cp_size=cp_size,
        kv_args=SimpleNamespace(page_size=PAGE, state_types=[]),
    )


def test_filter_hook_defers_to_upstream_without_the_flag():
    calls = []

    def upstream(kv_mgr, kv_indices, index_slice):
        calls.append(index_slice)
        return kv_indices, index_slice

    pages = np.array([4, 5, 6], dtype=np.int32)
    assert filter_kv_indices_for_cp_rank_around(upstream, _kv_mgr(False), pages, slice(0, 3))[1] == slice(0, 3)
    src, dst = filter_kv_indices_for_cp_rank_around(upstream, _kv_mgr(True), pages, slice(3, 6))
    assert calls == [slice(0, 3)]
    assert src.tolist() == [2] and dst.tolist() == [4]  # page 5 is rank 1's physical page 2


def test_upstream_filter_would_send_pages_a_rank_does_not_hold():
    """Why the replacement exists: upstream assigns contiguous ranges, not owners."""
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_cp_rank

    pages = np.arange(8, 16, dtype=np.int32)
    upstream_pages, _ = filter_kv_indices_for_cp_rank(_kv_mgr(False, cp_rank=0), pages, slice(0, 8))
    assert any(lane_of(int(p), 2) != 0 for p in upstream_pages)


def test_nsa_state_pairs_are_filtered_to_owned_pages_other_states_untouched():
    layout = CpSharedKVLayout(2, 0, PAGE)
    src, dst = owned_state_pages(layout, [4, 5, 6, 7, 8], [50, 51, 52, 53])  # dst shorter
    assert src == [2, 3] and dst == [50, 52]
    state_src, state_dst = filter_nsa_state_indices(
        layout, ["swa", "nsa"], [[1, 2], [4, 5, 6]], [[9, 9], [70, 71, 72]], nsa_state_type="nsa"
    )
    assert state_src == [[1, 2], [2, 3]] and state_dst == [[9, 9], [70, 72]]


def test_maybe_send_extra_hook_sends_owned_index_pages_only():
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.mooncake.conn import TransferInfo

    req = TransferInfo(
        room=1, endpoint="e", dst_port=1, mooncake_session_id="s", dst_kv_indices=np.arange(4),
        dst_aux_index=0, dst_state_indices=[[60, 61, 62, 63]], required_dst_info_num=1, is_dummy=False,
    )
    mgr = _kv_mgr(True, cp_rank=1)
    mgr.kv_args.state_types = [StateType.NSA]
    seen = []

    def upstream(self, req, prefill_state_indices, executor, info=None):
        seen.append((req.dst_state_indices, prefill_state_indices))
        return 0

    maybe_send_extra_around(upstream, mgr, req, [[10, 11, 12, 13]], executor=None)
    assert seen == [([[61, 63]], [[5, 6]])]
    assert req.dst_state_indices == [[60, 61, 62, 63]]  # caller's request untouched
    assert dataclasses.is_dataclass(req)


def test_hisparse_sender_takes_the_owned_page_positions_of_the_shared_kv_filter():
    """Decode with --enable-hisparse: upstream reads ``.start`` on the filter's result."""
    from sglang_cp_hicache.v0_5_12.disaggregation.mooncake.conn import send_kvcache_hisparse_around
    from sglang_cp_hicache.v0_5_12.disaggregation.utils import filter_kv_indices_for_shared_kv

    page = 4
    layout = CpSharedKVLayout(2, 1, page)
    logical_pages = np.array([10, 7, 13, 4, 9], dtype=np.int32)  # owners 0, 1, 1, 0, 1
    num_tokens = 5 * page - 2  # the last page is partial
    dst_kv_indices = np.arange(1000, 1000 + num_tokens)
    src_pages, positions = filter_kv_indices_for_shared_kv(layout, logical_pages, slice(0, 5))
    assert isinstance(positions, np.ndarray)
    mgr = SimpleNamespace(kv_args=SimpleNamespace(page_size=page, kv_item_lens=[8 * page], kv_data_ptrs=[1]))
    sent = {}

    def generic(**kwargs):
        sent.update(kwargs)
        return 0

    mgr._send_kvcache_generic = generic

    def upstream(*args):
        raise AssertionError("upstream would read .start on an ndarray")

    assert send_kvcache_hisparse_around(upstream, mgr, "s", src_pages, [2], dst_kv_indices, positions, None) == 0
    # Owned pages 7, 13, 9 are physical 3, 6, 4, at request positions 1, 2, 4 (the last partial).
    expected_src = [12, 13, 14, 15, 24, 25, 26, 27, 16, 17]
    expected_dst = [1004, 1005, 1006, 1007, 1008, 1009, 1010, 1011, 1016, 1017]
    assert sent["prefill_data_indices"].tolist() == expected_src
    assert sent["dst_data_indices"].tolist() == expected_dst
    assert sent["item_lens"] == [8]

    calls = []
    send_kvcache_hisparse_around(lambda *a: calls.append(a[5]), mgr, "s", src_pages, [2], dst_kv_indices, slice(0, 2), None)
    assert calls == [slice(0, 2)]  # upstream's own slice passes through


def test_upstream_unsharded_cp_filter_loses_pages_of_a_non_contiguous_request():
    """Pins upstream 0.5.12's unsharded CP transfer bug the real servers showed
    (``docs/serving_on_cpu.md``): ``page_indices_to_cp_rank_page_indices`` cuts the range
    ``[min(page), min(page) + n)`` among the ranks, so a request whose pages are not one
    contiguous range (a prefix hit, a fragmented pool) has pages no rank sends, while every
    rank reports Success. The plugin's owner filter sends each page exactly once."""
    from sglang.srt.disaggregation.utils import page_indices_to_cp_rank_page_indices

    pages = np.array([10, 3, 7, 20, 11], dtype=np.int32)  # 2 cached pages, then 3 new ones
    upstream = [page_indices_to_cp_rank_page_indices(pages, len(pages), rank, 2) for rank in range(2)]
    sent = np.concatenate(upstream)
    assert len(np.unique(sent)) < len(pages)  # pages 7, 10, 11, 20 fall outside [3, 8)
    positions = [owned_pages_for_transfer(CpSharedKVLayout(2, rank, PAGE), pages).dst_positions for rank in range(2)]
    assert sorted(np.concatenate(positions).tolist()) == list(range(len(pages)))  # each page once
