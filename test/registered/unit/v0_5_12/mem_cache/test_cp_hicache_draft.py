"""The MTP draft's KV on host under CP HiCache: one host object with the target's.

Real SGLang pools on the CPU runtime (rank 0 of CP 2): the target's NSA stack and the
draft's one-layer NSA pool, handed to the cache as the scheduler hook hands it. Target and
draft host pools share one per-rank byte budget, one page table and the same physical
slots; every backup, load, eviction and reset moves both under one node id with one ack.
"""

import pytest
import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
)

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import (
    PAYLOAD_DRAFT,
    PAYLOAD_TARGET,
    CpHiCacheMetadataError,
    PageRun,
)
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import (
    CpHostPoolGroup,
    host_group_bytes,
    nsa_host_stack_bytes,
)
from sglang_cp_hicache.v0_5_12.server_args import CpSharedKVConfigError
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
LAYERS = 3


def _cfg(**overrides):
    base = dict(cp_size=2, layer_num=LAYERS, physical_tokens=PS * 16, draft=True)
    base.update(overrides)
    return nsa_stack.StackConfig(**base)


@pytest.fixture
def stack(gloo_world1):
    built = nsa_stack.build_rank_stack(_cfg(), 0, None, gloo_world1)
    yield built
    built.close()


def _host(stack):
    group = stack.cache.cache_controller.mem_pool_host
    assert isinstance(group, CpHostPoolGroup) and group.draft is not None
    return group


def _free(stack):
    """(target, draft) free host slots of this rank."""
    group = _host(stack)
    return group.available_size(), group.draft.available_size()


def _prefill(stack, tokens, owners=None):
    """Owned target + draft KV of a new leaf at the root, inserted (write-through backs it
    up all layers at once) and its ack popped; the node."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    if owners is None:
        locs = stack.allocator.alloc(len(tokens))
    else:
        locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
    nsa_stack.write_prefill_kv(stack, locs, torch.tensor(tokens), torch.arange(len(tokens)))
    key = nsa_stack.radix_key(tokens)
    stack.cache.insert(InsertParams(key=key, value=locs))
    stack.cache.check_hicache_events()
    return stack.cache.root_node.children[key.child_key(PS)]


def _evict_device_and_wipe(stack):
    stack.cache.evict(EvictParams(num_tokens=10**9))
    nsa_stack.wipe_device_kv(stack)


def _load_back(stack, tokens):
    cache = stack.cache
    match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
    )
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    return match, loaded


# ------------------------------------------------------------------ one budget
def test_host_budget_with_draft_equals_the_budget_without_it_in_bytes(gloo_world1):
    alone = nsa_stack.build_rank_stack(_cfg(draft=False), 0, None, gloo_world1)
    with_draft = nsa_stack.build_rank_stack(_cfg(), 0, None, gloo_world1)
    try:
        budget = host_group_bytes(alone.cache.cache_controller.mem_pool_host)
        group = _host(with_draft)
        target_bytes, draft_bytes = host_group_bytes(group), host_group_bytes(group.draft)
        split = with_draft.cache.host_budget
        # The budget is what SGLang allocates for the target alone at these flags.
        assert split.budget_bytes == budget
        assert (split.target_bytes, split.draft_bytes) == (target_bytes, draft_bytes)
        assert target_bytes + draft_bytes <= budget
        # One page table: both pools have the same slots, and the table covers them.
        assert group.draft.size == group.size == split.pages * PS
        controller = with_draft.cache.cache_controller
        assert controller.host_table.physical_host_pages == split.pages
        # The draft gets the token capacity its footprint allows: one more page would not fit.
        target_pool, draft_pool = with_draft.kv_pool, with_draft.draft_pool
        one_more = nsa_host_stack_bytes(target_pool, split.pages + 1, PS) + nsa_host_stack_bytes(
            draft_pool, split.pages + 1, PS
        )
        assert one_more > budget
        assert split.pages < alone.cache.cache_controller.mem_pool_host.size // PS
        usage = with_draft.cache.cp_host_usage()
        assert (usage["target_host_bytes"], usage["draft_host_bytes"]) == (target_bytes, draft_bytes)
    finally:
        alone.close()
        with_draft.close()


def test_a_budget_too_small_for_target_and_draft_is_refused_with_the_figures(gloo_world1):
    # ratio 1.2 alone gives 20 pages > 16 device pages; shared with the draft, 14 pages.
    with pytest.raises(CpSharedKVConfigError, match=r"holds 14 pages of target \+ draft KV.*16 pages.*raise --hicache-ratio"):
        nsa_stack.build_rank_stack(_cfg(hicache_ratio=1.2), 0, None, gloo_world1)
    nsa_stack.build_rank_stack(_cfg(hicache_ratio=1.2, draft=False), 0, None, gloo_world1).close()


def test_a_speculative_server_without_its_draft_pool_is_refused_where_the_cache_is_built(
    gloo_world1, monkeypatch
):
    build_args = nsa_stack._server_args

    def speculative(cfg):
        server_args = build_args(cfg)
        server_args.speculative_algorithm = "EAGLE"
        return server_args

    monkeypatch.setattr(nsa_stack, "_server_args", speculative)
    with pytest.raises(CpSharedKVConfigError, match="built without the draft's KV pool"):
        nsa_stack.build_rank_stack(_cfg(draft=False), 0, None, gloo_world1)
    # With the draft pool handed over it is built; upstream HiCache is not the plugin's business.
    nsa_stack.build_rank_stack(_cfg(), 0, None, gloo_world1).close()
    nsa_stack.build_rank_stack(_cfg(draft=False), 0, None, gloo_world1, shared_kv=False).close()


# ------------------------------------------------------------------ write
def _reserve(stack, owners, node_id, ids_base=None):
    logical_locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
    ids = torch.arange(len(logical_locs)) + (100 * node_id if ids_base is None else ids_base)
    nsa_stack.write_prefill_kv(stack, logical_locs, ids, torch.arange(len(logical_locs)))
    controller = stack.cache.cache_controller
    plan = controller.host_table.plan_write(PageRun.of(logical_locs.numpy(), PS))
    return controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools())


def test_a_draft_allocation_failure_rolls_back_the_target_reservation(stack):
    controller = stack.cache.cache_controller
    group = _host(stack)
    target_free, draft_free = _free(stack)
    draft_kv = group.draft.anchor_entry.host_pool
    draft_kv.free_slots = draft_kv.free_slots[:PS]  # room for one page, the node needs two
    with pytest.raises(CpHiCacheMetadataError, match=r"node 7 on CP rank 0: the draft host pool refused 128 slots"):
        _reserve(stack, [0, 1, 0], 7)
    assert group.available_size() == target_free  # the target's slots went back
    assert controller.host_table.used_logical_tokens() == 0
    assert controller.host_table.lane_used_pages() == [0, 0]
    assert group.draft.available_size() == PS


def test_draft_slots_other_than_the_targets_are_refused_and_both_released(stack):
    group = _host(stack)
    target_free, draft_free = _free(stack)
    draft_kv = group.draft.anchor_entry.host_pool
    draft_kv.free_slots = torch.roll(draft_kv.free_slots, -PS)  # same slots, another order
    with pytest.raises(CpHiCacheMetadataError, match="node 7 on CP rank 0: the draft host pool gave other slots"):
        _reserve(stack, [0, 1], 7)
    assert _free(stack) == (target_free, draft_free)
    assert stack.cache.cache_controller.host_table.used_logical_tokens() == 0


def test_an_all_layer_backup_moves_target_and_draft_with_one_ack(stack):
    controller = stack.cache.cache_controller
    pending = _reserve(stack, [0, 1, 0], 7)
    controller.submit_write(pending)
    assert [list(ack.node_ids) for ack in controller.ack_write_queue] == [[7]]
    group = _host(stack)
    host_rows = pending.operation.host_indices
    device_rows = pending.operation.device_indices
    for pool, host_pool in ((stack.kv_pool, group.anchor_entry.host_pool),
                            (stack.draft_pool, group.draft.anchor_entry.host_pool)):  # fmt: skip
        for layer in range(pool.layer_num):
            host_bytes = host_pool.kv_buffer[layer][host_rows].view(torch.uint8)
            assert torch.equal(host_bytes, pool.kv_buffer[layer][device_rows].view(torch.uint8))


# ------------------------------------------------------------------ load, evict, reset
def test_load_back_restores_target_and_draft_bytes(stack):
    tokens = list(range(1000, 1000 + 5 * PS))
    _prefill(stack, tokens)
    _evict_device_and_wipe(stack)
    match, loaded = _load_back(stack, tokens)
    assert match.host_hit_length == len(tokens) - len(tokens) % PS and len(loaded) == match.host_hit_length
    ids, pos = torch.tensor(tokens[: len(loaded)]), torch.arange(len(loaded))
    owned = int(stack.layout.owned_mask(loaded).sum())
    assert owned > 0
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0
    assert nsa_stack.count_draft_kv_mismatches(stack, loaded, ids, pos) == 0


def test_a_load_that_skips_the_draft_is_a_draft_mismatch(stack, monkeypatch):
    """The check above can fail: a load that moves only the target leaves wiped draft KV."""
    tokens = list(range(1000, 1000 + 5 * PS))
    _prefill(stack, tokens)
    _evict_device_and_wipe(stack)
    monkeypatch.setattr(_host(stack).draft, "load_to_device_per_layer", lambda *a, **k: None)
    _, loaded = _load_back(stack, tokens)
    ids, pos = torch.tensor(tokens[: len(loaded)]), torch.arange(len(loaded))
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0
    assert nsa_stack.count_draft_kv_mismatches(stack, loaded, ids, pos) > 0


def test_evicting_a_node_frees_its_target_and_draft_host_slots(stack):
    start = _free(stack)
    node = _prefill(stack, list(range(2000, 2000 + 4 * PS)), owners=[0, 1, 0, 0])
    assert node.backuped
    target_free, draft_free = _free(stack)
    assert start[0] - target_free == start[1] - draft_free == 3 * PS  # rank 0 owns 3 pages
    stack.cache.evict(EvictParams(num_tokens=10**9))
    stack.cache.evict_host(10**9)
    assert _free(stack) == start
    assert stack.cache.cache_controller.host_table.used_logical_tokens() == 0


def test_reset_frees_target_and_draft_host_slots(stack):
    start = _free(stack)
    _prefill(stack, list(range(3000, 3000 + 3 * PS)))
    assert _free(stack) != start
    stack.cache.reset()
    assert _free(stack) == start
    assert stack.cache.cache_controller.host_table.used_logical_tokens() == 0


def test_a_page_without_the_draft_payload_fails_fast_naming_node_and_rank(stack):
    tokens = list(range(4000, 4000 + 3 * PS))
    node = _prefill(stack, tokens)
    table = stack.cache.cache_controller.host_table
    assert table.payload == PAYLOAD_TARGET | PAYLOAD_DRAFT
    page = int(node.host_value[0]) // PS
    table._page_payload[page] = PAYLOAD_TARGET  # the draft's payload of this page is lost
    _evict_device_and_wipe(stack)
    with pytest.raises(
        CpHiCacheMetadataError,
        match=rf"node {node.id} on CP rank 0: logical host page {page} holds target KV, the cache keeps target \+ draft KV",
    ):
        _load_back(stack, tokens)


# ------------------------------------------------------------------ per-layer backup
def _draft_host_rows(stack, host_rows):
    """The draft's host KV rows as bytes (unwritten host memory may hold NaN patterns)."""
    draft_kv = _host(stack).draft.anchor_entry.host_pool
    return draft_kv.kv_buffer[0][host_rows].view(torch.uint8)


def test_per_layer_backup_moves_the_draft_layer_after_the_draft_forward_then_acks_once(stack):
    from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup

    controller = stack.cache.cache_controller
    held = [_reserve(stack, [0, 1, 0], 7), _reserve(stack, [1, 1], 8)]  # 8: rank 0 owns none
    for pending in held:
        controller.submit_write(pending, per_layer=True)
    host_rows = held[0].operation.host_indices
    device_rows = held[0].operation.device_indices
    before = _draft_host_rows(stack, host_rows).clone()
    for layer in range(LAYERS):
        cp_layer_backup.notify_layer_stored(stack.kv_pool, layer)
    cp_layer_backup.notify_forward_end(stack.kv_pool)  # the target forward ends: the draft's comes
    assert controller.ack_write_queue == []
    assert controller.held_write_node_ids == [7, 8]
    assert torch.equal(_draft_host_rows(stack, host_rows), before)  # nothing of the draft yet
    cp_layer_backup.notify_layer_stored(stack.draft_pool, 0)
    assert [list(ack.node_ids) for ack in controller.ack_write_queue] == [[7, 8]]
    assert torch.equal(
        _draft_host_rows(stack, host_rows), stack.draft_pool.kv_buffer[0][device_rows].view(torch.uint8)
    )
    draft_index = _host(stack).draft.get_pool(_indexer())
    pages = host_rows[::PS] // PS
    assert torch.equal(
        draft_index.index_k_with_scale_buffer[0][pages],
        stack.draft_pool.index_k_with_scale_buffer[0][device_rows[::PS] // PS],
    )
    cp_layer_backup.notify_forward_end(stack.draft_pool)
    assert controller.held_write_node_ids == []


def _indexer():
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return PoolName.INDEXER


def test_a_draft_forward_ending_without_its_layer_names_nodes_and_rank(stack):
    from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
    from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete

    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0, 1], 7), per_layer=True)
    for layer in range(LAYERS):
        controller.backup_layer(layer)
    with pytest.raises(PerLayerBackupIncomplete, match=r"CP rank 0: .*nodes \[7\].*not the draft's.*draft forward ended"):
        cp_layer_backup.notify_forward_end(stack.draft_pool)
    assert controller.held_write_node_ids == [] and controller.ack_write_queue == []


def test_the_next_forward_before_the_draft_layer_fails_fast(stack):
    from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete

    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0], 7), per_layer=True)
    for layer in range(LAYERS):
        controller.backup_layer(layer)
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[7\].*before the draft forward stored its layer"):
        controller.submit_write(_reserve(stack, [0], 8), per_layer=True)
    # A target forward with nothing held is just as early: the draft forward never ran.
    controller.submit_write(_reserve(stack, [0], 9), per_layer=True)
    for layer in range(LAYERS):
        controller.backup_layer(layer)
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[9\].*a target forward started before the draft"):
        controller.backup_layer(0)


def test_a_per_layer_backup_awaiting_the_draft_layer_cannot_be_rolled_back(stack):
    controller = stack.cache.cache_controller
    pending = _reserve(stack, [0], 7)
    controller.submit_write(pending, per_layer=True)
    for layer in range(LAYERS):
        controller.backup_layer(layer)
    with pytest.raises(CpHiCacheMetadataError, match="node 7 on CP rank 0: rollback of a per-layer backup"):
        controller.rollback_write(pending)
    controller.layer_pipeline.backup_draft_layer(0)
    controller.rollback_write(pending)  # after the ack: allowed


@pytest.mark.parametrize("ratio, size_gb", [(2.0, 0), (3.7, 0), (2.0, 1)])
def test_the_budget_starts_from_sglangs_own_host_page_count(monkeypatch, ratio, size_gb):
    """split_host_budget repeats HostKVCache's page count (--hicache-ratio, or --hicache-size
    sizing MLA KV only); pinned against SGLang's class, without allocating its buffers."""
    from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost

    from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import sglang_host_pages

    pool = nsa_stack.build_kv_pool(_cfg())
    monkeypatch.setattr(
        MLATokenToKVPoolHost,
        "init_kv_buffer",
        lambda self: torch.empty((self.layer_num, 0, 1, self.kv_cache_dim), dtype=self.dtype),
    )
    host = MLATokenToKVPoolHost(pool, ratio, size_gb, PS, "layer_first", override_kv_cache_dim=pool.kv_cache_dim)
    assert sglang_host_pages(pool, PS, ratio, size_gb) == host.page_num
