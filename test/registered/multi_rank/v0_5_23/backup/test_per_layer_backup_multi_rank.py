"""Per-layer D2H backup on SGLang 0.5.23's REAL sharded stack, on every rank of a gloo CP group.

Each rank builds the real stack (``sharded_stack``, the plugin's flag on, the plugin's
hooks applied) and runs the same logical workload: host slots reserved before a forward for
each request's new pages, then a forward whose layers store their KV through the sharded
pool's own ``set_mla_kv_buffer`` (the store hook reports each layer), then the insert and
``writing_check`` (upstream's MIN all-reduce pops the one ack). Request C is one page: one
rank owns none of it and must still ack. The same workload with the flag off is upstream's
all-layer path, so each "flag on" assertion below is one upstream's behaviour fails.

Every test runs on both host layouts: ``layer_first`` (upstream's one-layer D2H ops) and
``page_first`` (0.5.23's default, the Mooncake store's: the JIT one-layer kernel over
per-layer strided views of the latent and indexer host buffers).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LAYERS = 2
SEED = 20261202
_A = list(range(1, 5 * PAGE + 1))
_C = list(range(20_001, 20_001 + PAGE))
REQUESTS: Tuple[List[int], ...] = (_A, _C)
SKIPS = ("layer1_first", "ends_after_layer0", "stored_in_parts")
LAYOUTS = ("layer_first", "page_first")


def _stack(ctx: RankContext, cp_shared_kv: bool, layout: str):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    return sharded_stack(ctx, StackConfig(layer_num=LAYERS, cp_shared_kv=cp_shared_kv, mem_layout=layout))


def _logical_kv(stack, token_ids: Sequence[int]):
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import logical_kv

    return logical_kv(stack, len(token_ids), LAYERS, SEED + token_ids[0])


def _store_layer(stack, layer_id: int, batch) -> None:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import store_layer

    store_layer(stack, layer_id, batch)


def _forward(stack, batch) -> None:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import forward

    forward(stack, batch)


def _host_mismatches(stack, locs: torch.Tensor, host_locs: torch.Tensor, layers) -> List[str]:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import host_mismatches

    return host_mismatches(stack, locs, host_locs, layers)


def _node_of(stack, tokens):
    match = stack.match(tokens)
    return stack.cache.tree_core.node_by_id(match.last_device_node)


def happy_path(ctx: RankContext, cp_shared_kv: bool, layout: str) -> Dict[str, object]:
    """Reserve -> forward (layer by layer) -> insert -> ack -> evict -> load back."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of, notify_forward_end

    report: Dict[str, object] = {}
    with _stack(ctx, cp_shared_kv, layout) as stack:
        backup = layer_backup_of(stack.cache)
        report["attached"] = backup is not None
        start = (stack.device_available(), stack.host_available())
        empty = torch.empty((0,), dtype=torch.int64)
        plan = []
        for index, tokens in enumerate(REQUESTS):
            rid = f"r{index}"
            locs, base = stack.alloc_extend(empty, len(tokens), rotation_base=index)
            ticket = backup.reserve(rid, locs, base) if backup is not None else None
            plan.append((rid, tokens, locs, base, ticket, _logical_kv(stack, tokens)))
        report["tickets_ride_in_ongoing"] = [
            ticket in stack.cache.ongoing_write_through for *_, ticket, _ in plan
        ]
        acks_before = len(stack.controller.ack_write_queue)
        layer0_on_host = []
        for layer in range(LAYERS):
            _store_layer(stack, layer, [(p[2], p[5]) for p in plan])
            if layer == 0:  # before the last layer's store: layer 0 is on host already
                for rid, _, locs, *_ in plan:
                    held = backup.reservations.get(rid) if backup is not None else None
                    layer0_on_host.append(
                        held is not None
                        and _host_mismatches(stack, locs, held.write.host_indices, [0]) == []
                    )
                report["acks_after_layer0"] = len(stack.controller.ack_write_queue) - acks_before
        notify_forward_end(stack.kv_pool)
        report["layer0_on_host_before_last_layer"] = layer0_on_host
        report["acks_after_forward"] = len(stack.controller.ack_write_queue) - acks_before
        report["owned_pages"] = [int(stack.owned_mask(p[2][::PAGE]).sum()) for p in plan]
        for _, tokens, locs, base, _, _ in plan:
            stack.insert(tokens, locs, base)
        nodes = [_node_of(stack, tokens) for _, tokens, *_ in plan]
        report["pending_before_ack"] = [n.write_through_pending_id is not None for n in nodes]
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        report["on_device_before_ack"] = [_on_device(stack, p[1]) for p in plan]
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        report["pending_after_ack"] = [n.write_through_pending_id is not None for n in nodes]
        report["ongoing_after_ack"] = sorted(stack.cache.ongoing_write_through)
        report["host_mismatches"] = [
            _host_mismatches(stack, p[2], _node_host_value(n), range(LAYERS))
            for n, p in zip(nodes, plan)
        ]
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        report["on_device_after_ack"] = [_on_device(stack, p[1]) for p in plan]
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        report["free_counts"] = (start, (stack.device_available(), stack.host_available()))
    return report


def _node_host_value(node) -> torch.Tensor:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return node.component_data[ComponentType.FULL].host_value


def _on_device(stack, tokens) -> bool:
    return stack.match(tokens).device_prefix_len == len(tokens)



def zero_owned_and_rollback(ctx: RankContext, layout: str) -> Dict[str, object]:
    """A forward whose pages rank 0 owns none of, an aborted request's rollback, then two
    forwards that skip a layer."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    report: Dict[str, object] = {}
    with _stack(ctx, True, layout) as stack:
        backup = layer_backup_of(stack.cache)
        start = (stack.device_available(), stack.host_available())
        empty = torch.empty((0,), dtype=torch.int64)
        # C: one page at rotation base 1, on rank 1 only.
        locs, base = stack.alloc_extend(empty, len(_C), rotation_base=1)
        backup.reserve("c", locs, base)
        queue = stack.controller.ack_write_queue
        before = len(queue)
        _forward(stack, [(locs, _logical_kv(stack, _C))])
        report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        report["acks"] = len(queue) - before
        report["ack_ids"] = [list(ack.node_ids) for ack in queue[before:]]
        stack.insert(_C, locs, base)
        stack.cache.writing_check()
        node = _node_of(stack, _C)
        report["c_committed"] = node.backuped and node.write_through_pending_id is None
        # D: reserved, forwarded, then aborted before its insert.
        tokens = list(range(30_001, 30_001 + 2 * PAGE))
        locs, base = stack.alloc_extend(empty, len(tokens), rotation_base=0)
        host_before = stack.host_available()
        backup.reserve("d", locs, base)
        _forward(stack, [(locs, _logical_kv(stack, tokens))])
        backup.settle("d")  # abort / retraction: no insert will claim it
        report["host_held_until_ack"] = stack.host_available() < host_before
        stack.cache.writing_check()
        report["host_back_at_ack"] = stack.host_available() == host_before
        stack.allocator.free(locs)  # the aborted request's own pages
        report["ongoing"] = sorted(stack.cache.ongoing_write_through)
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        report["free_counts"] = (start, (stack.device_available(), stack.host_available()))
        report["split"] = _split_pending_node(stack)
        # Last: a failed forward leaves its ticket without an ack (the rank must stop).
        report["skipped"] = {how: _skipped_layer(stack, how) for how in SKIPS}
    return report


def _split_pending_node(stack) -> Dict[str, object]:
    """E is claimed and pending when F, sharing E's first two pages, splits its node; the
    ack then publishes both parts, and E reloaded from host reads back byte-exact."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    out: Dict[str, object] = {}
    tokens_e = list(range(60_001, 60_001 + 4 * PAGE))
    kv = _logical_kv(stack, tokens_e)
    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens_e), 0)
    layer_backup_of(stack.cache).reserve("e", locs, base)
    _forward(stack, [(locs, kv)])
    stack.insert(tokens_e, locs, base)
    tokens_f = tokens_e[: 2 * PAGE] + list(range(70_001, 70_001 + PAGE))
    prefix = locs[: 2 * PAGE]
    locs_f, _ = stack.alloc_extend(prefix, len(tokens_f), base)
    stack.insert(tokens_f, torch.cat([prefix, locs_f]), base, cached_len=2 * PAGE)
    parts = [_node_of(stack, tokens_e[: 2 * PAGE]), _node_of(stack, tokens_e)]
    out["split_while_pending"] = parts[0].id != parts[1].id and all(
        n.write_through_pending_id is not None for n in parts
    )
    stack.cache.flush_pending_backups()
    stack.cache.writing_check()
    out["published"] = [n.write_through_pending_id is None and n.backuped for n in parts]
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    for layer in range(LAYERS):  # the reload must write every byte it is checked on
        stack.kv_pool.kv_buffer[layer].zero_()
        stack.kv_pool.index_k_with_scale_buffer[layer].zero_()
    match = stack.match(tokens_e)
    out["host_hit"] = match.host_hit_length
    assert stack.cache.load_back(match.best_match_node)
    stack.cache.ready_to_load_host_cache()
    stack.cache.loading_check()
    reloaded = stack.cache.path_device_indices(stack.match(tokens_e).last_device_node)
    out["reload_mismatches"] = _device_mismatches(stack, reloaded, kv)
    return out


def _device_mismatches(stack, locs: torch.Tensor, kv) -> List[str]:
    """Owned device latent rows and indexer pages at ``locs`` that differ from ``kv``."""
    latent, indexer = kv
    owned = stack.owned_mask(locs)
    rows = stack.physical_rows(locs)
    first = locs[::PAGE]
    page_positions = torch.nonzero(stack.owned_mask(first)).squeeze(1)
    page_rows = stack.physical_rows(first) // PAGE
    bad = []
    for layer in range(LAYERS):
        differs = (stack.kv_pool.kv_buffer[layer][rows] != latent[layer][owned]).flatten(1).any(1)
        bad += [f"layer {layer} latent row {int(r)}" for r in rows[differs]]
        pages = stack.kv_pool.index_k_with_scale_buffer[layer][page_rows]
        differs = (pages != indexer[layer][page_positions]).any(1)
        bad += [f"layer {layer} indexer page {int(p)}" for p in page_rows[differs]]
    return bad


def _skipped_layer(stack, how: str) -> str:
    """A forward that reports layer 1 first, ends after layer 0, or stores layer 0 in two
    parts: the error message."""
    from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of, notify_forward_end

    first = 40_001 + 1_000 * SKIPS.index(how)
    tokens = list(range(first, first + 2 * PAGE))
    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens), 0)
    layer_backup_of(stack.cache).reserve(how, locs, base)
    batch = [(locs, _logical_kv(stack, tokens))]
    try:
        if how == "layer1_first":
            _store_layer(stack, 1, batch)
        elif how == "stored_in_parts":  # e.g. two-batch overlap's micro-batches
            latent, indexer = batch[0][1]
            _store_layer(stack, 0, [(locs[:PAGE], (latent[:, :PAGE], indexer[:, :1]))])
        else:
            _store_layer(stack, 0, batch)
            notify_forward_end(stack.kv_pool)
    except PerLayerBackupIncomplete as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def scenario(ctx: RankContext, layout: str) -> Dict[str, object]:
    """Every workload on one rank, in one process (one SGLang import per rank): the flag
    on, the flag off (upstream), then zero-owned, rollback and skipped layers."""
    return {
        "on": happy_path(ctx, True, layout),
        "off": happy_path(ctx, False, layout),
        "zero": zero_owned_and_rollback(ctx, layout),
    }


@pytest.fixture(scope="module", params=LAYOUTS)
def reports(request) -> List[Dict[str, object]]:
    return run_ranks(2, scenario, request.param)


@pytest.fixture(scope="module")
def happy(reports) -> Dict[bool, List[Dict[str, object]]]:
    """Rank reports with the flag on (per-layer) and off (upstream's all-layer path)."""
    return {on: [r["on" if on else "off"] for r in reports] for on in (True, False)}


@pytest.fixture(scope="module")
def zero_owned(reports) -> List[Dict[str, object]]:
    return [r["zero"] for r in reports]


def test_the_flag_attaches_per_layer_backup_and_off_is_upstream(happy):
    assert all(r["attached"] for r in happy[True])
    assert not any(r["attached"] for r in happy[False])


def test_each_layer_reaches_host_before_the_last_layer_is_stored(happy):
    for rank, report in enumerate(happy[True]):
        assert report["layer0_on_host_before_last_layer"] == [True, True], f"rank {rank}"
        assert report["acks_after_layer0"] == 0, f"rank {rank}: acked before the last layer"
    # Upstream's all-layer path copies nothing until the insert.
    assert not any(any(r["layer0_on_host_before_last_layer"]) for r in happy[False])


def test_one_ack_per_forward_after_the_last_layer_on_every_rank(happy):
    for rank, report in enumerate(happy[True]):
        assert report["acks_after_forward"] == 1, f"rank {rank}"
        assert report["tickets_ride_in_ongoing"] == [True, True], f"rank {rank}"
        assert report["ongoing_after_ack"] == [], f"rank {rank}"
    assert sorted(r["owned_pages"][1] for r in happy[True]) == [0, 1]  # C: one rank owns none


def test_node_is_host_visible_only_at_the_ack(happy):
    for rank, report in enumerate(happy[True]):
        assert report["pending_before_ack"] == [True, True], f"rank {rank}"
        assert report["on_device_before_ack"] == [True, True], f"rank {rank}: evicted before its ack"
        assert report["pending_after_ack"] == [False, False], f"rank {rank}"
        assert report["on_device_after_ack"] == [False, False], f"rank {rank}: not demotable after its ack"


def test_host_bytes_are_byte_exact_per_owned_page_after_the_ack(happy):
    for on, reports in happy.items():
        for rank, report in enumerate(reports):
            assert report["host_mismatches"] == [[], []], f"flag {on}, rank {rank}"


def test_free_counts_return(happy):
    for rank, report in enumerate(happy[True]):
        start, end = report["free_counts"]
        assert end == start, f"rank {rank}: (device, host) free {end} != start {start}"


def test_a_rank_owning_nothing_still_acks(zero_owned):
    assert [r["owned_pages"] for r in zero_owned] == [0, 1]
    for rank, report in enumerate(zero_owned):
        assert report["acks"] == 1, f"rank {rank}"
        assert report["ack_ids"] == zero_owned[0]["ack_ids"], f"rank {rank}: ack queues differ"
        assert report["c_committed"], f"rank {rank}"


def test_rollback_on_abort_only_at_the_ack_and_free_counts_return(zero_owned):
    for rank, report in enumerate(zero_owned):
        assert report["host_held_until_ack"], f"rank {rank}: freed while the copy may write"
        assert report["host_back_at_ack"], f"rank {rank}"
        assert report["ongoing"] == [], f"rank {rank}"
        start, end = report["free_counts"]
        assert end == start, f"rank {rank}: (device, host) free {end} != start {start}"


@pytest.mark.parametrize("how", SKIPS)
def test_a_forward_that_skips_a_layer_fails_fast(zero_owned, how):
    for rank, report in enumerate(zero_owned):
        message = report["skipped"][how]
        assert message.startswith("PerLayerBackupIncomplete") and f"CP rank {rank}" in message, message


def test_a_split_of_a_pending_node_is_published_at_the_ack_and_reads_back(zero_owned):
    for rank, report in enumerate(zero_owned):
        split = report["split"]
        assert split["split_while_pending"], f"rank {rank}"
        assert split["published"] == [True, True], f"rank {rank}"
        assert split["host_hit"] == 4 * PAGE, f"rank {rank}"
        assert split["reload_mismatches"] == [], f"rank {rank}"

