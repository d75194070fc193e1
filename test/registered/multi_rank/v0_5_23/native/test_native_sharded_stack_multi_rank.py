"""SGLang 0.5.23's native sharded DSA HiCache stack, real on every rank of a gloo CP group.

Each rank builds its own real stack (``testing.v0_5_23.stack.sharded_stack``) and runs
the same logical workload: three requests (one extends another's prefix, one is a single
page), write-through backup, device eviction, host hits, load-back. Each rank writes the
bytes of the full logical KV (MLA latent rows and DSA indexer pages, one seeded draw shared
by all ranks) into the physical rows it owns, and after the reload compares what it reads
from its own rows with what was written for those positions. Run at CP 2 and 3, for both
layouts sharding accepts with kernel I/O (layer_first and page_first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LAYERS = 2
SEED = 20261201
# (token ids, tokens shared with request A): B extends A's first two pages.
_A = list(range(1, 5 * PAGE + 1))
_B = _A[: 2 * PAGE] + list(range(10_001, 10_001 + 2 * PAGE))
_C = list(range(20_001, 20_001 + PAGE))
REQUESTS: Tuple[Tuple[List[int], int], ...] = ((_A, 0), (_B, 2 * PAGE), (_C, 0))


@dataclass(frozen=True)
class LogicalKV:
    """The full logical KV of one request, by token position (identical on every rank)."""

    latent: torch.Tensor  # [layer, token, 1, kv_cache_dim] bf16
    indexer: torch.Tensor  # [layer, page, page_size * 132] uint8


def _logical_kv(stack, token_ids: Sequence[int]) -> LogicalKV:
    kv_pool = stack.kv_pool
    generator = torch.Generator().manual_seed(SEED + token_ids[0] + len(token_ids))
    latent_row = kv_pool.kv_buffer[0].shape[1:]
    index_page = kv_pool.index_k_with_scale_buffer[0].shape[1:]
    latent = torch.randn((LAYERS, len(token_ids), *latent_row), generator=generator)
    indexer = torch.randint(
        0, 256, (LAYERS, len(token_ids) // PAGE, *index_page), generator=generator
    )
    return LogicalKV(latent.to(kv_pool.kv_buffer[0].dtype), indexer.to(torch.uint8))


def _logical_kvs(stack) -> List[LogicalKV]:
    """One per request; a shared prefix carries the bytes of the request it extends."""
    kvs = [_logical_kv(stack, tokens) for tokens, _ in REQUESTS]
    for index, (_, shared) in enumerate(REQUESTS):
        if shared:
            kvs[index].latent[:, :shared] = kvs[0].latent[:, :shared]
            kvs[index].indexer[:, : shared // PAGE] = kvs[0].indexer[:, : shared // PAGE]
    return kvs


def _owned_pages(stack, logical_locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page positions this rank owns, their physical page rows) of a page-aligned run."""
    first_slots = logical_locs[::PAGE]
    owned = stack.owned_mask(first_slots)
    positions = torch.nonzero(owned).squeeze(1)
    return positions, stack.physical_rows(first_slots) // PAGE


def write_owned_rows(stack, logical_locs: torch.Tensor, kv: LogicalKV, positions: slice) -> None:
    """Store the owned share of ``kv[positions]`` at ``logical_locs`` (what a forward does)."""
    latent_positions = torch.arange(len(kv.latent[0]))[positions]
    owned = stack.owned_mask(logical_locs)
    rows = stack.physical_rows(logical_locs)
    page_positions, page_rows = _owned_pages(stack, logical_locs)
    first_page = latent_positions[0].item() // PAGE
    for layer in range(LAYERS):
        stack.kv_pool.kv_buffer[layer][rows] = kv.latent[layer][latent_positions[owned]]
        index_buffer = stack.kv_pool.index_k_with_scale_buffer[layer]
        index_buffer[page_rows] = kv.indexer[layer][first_page + page_positions]


def owned_row_mismatches(stack, logical_locs: torch.Tensor, kv: LogicalKV) -> List[str]:
    """Owned latent rows and indexer pages at ``logical_locs`` that differ from ``kv``."""
    owned = stack.owned_mask(logical_locs)
    rows = stack.physical_rows(logical_locs)
    page_positions, page_rows = _owned_pages(stack, logical_locs)
    mismatches = []
    for layer in range(LAYERS):
        latent = stack.kv_pool.kv_buffer[layer][rows]
        bad = (latent != kv.latent[layer][owned]).flatten(1).any(1)
        mismatches += [f"layer {layer} latent row {int(r)}" for r in rows[bad]]
        pages = stack.kv_pool.index_k_with_scale_buffer[layer][page_rows]
        bad = (pages != kv.indexer[layer][page_positions]).any(1)
        mismatches += [f"layer {layer} indexer page {int(p)}" for p in page_rows[bad]]
    return mismatches


def _prefix_locs(stack, token_ids: Sequence[int], shared: int) -> Tuple[torch.Tensor, object]:
    if not shared:
        return torch.empty((0,), dtype=torch.int64), None
    match = stack.match(token_ids[:shared])
    assert match.device_prefix_len == shared
    return stack.cache.path_device_indices(match.last_device_node), stack.cache.rotation_base_of(
        match.last_device_node
    )


def _evict_all(stack) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    for layer in range(LAYERS):  # a reload must write every byte it is checked on
        stack.kv_pool.kv_buffer[layer].zero_()
        stack.kv_pool.index_k_with_scale_buffer[layer].zero_()


def _load_back(stack, token_ids: Sequence[int]) -> torch.Tensor:
    """Load ``token_ids``' host hit back; return the whole match's logical device locs."""
    match = stack.match(token_ids)
    assert match.host_hit_length > 0, "nothing on host to load back"
    assert stack.cache.load_back(match.best_match_node)
    stack.cache.ready_to_load_host_cache()
    stack.cache.loading_check()
    assert not stack.cache.ongoing_load_back, "load-back not acked on this rank"
    match = stack.match(token_ids)
    assert match.device_prefix_len == len(token_ids) and match.host_hit_length == 0
    return stack.cache.path_device_indices(match.last_device_node)


def scenario(ctx: RankContext, mem_layout: str) -> Dict[str, object]:
    """One rank's share of the workload; returns what the main process compares."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    with sharded_stack(ctx, StackConfig(mem_layout=mem_layout), plugin_hooks=False) as stack:
        start = (stack.device_available(), stack.host_available())
        kvs = _logical_kvs(stack)
        for (tokens, shared), kv in zip(REQUESTS, kvs):
            prefix, base = _prefix_locs(stack, tokens, shared)
            locs, base = stack.alloc_extend(prefix, len(tokens), base)
            write_owned_rows(stack, locs, kv, slice(shared, None))
            stack.insert(tokens, torch.cat([prefix, locs]), base, cached_len=shared)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        report["pending_acks"] = sorted(stack.cache.ongoing_write_through)
        report["tree_backed_up"] = stack.tree_snapshot()
        _evict_all(stack)
        report["tree_evicted"] = stack.tree_snapshot()
        mismatches = []
        for (tokens, _), kv in zip(REQUESTS, kvs):
            locs = _load_back(stack, tokens)
            mismatches += owned_row_mismatches(stack, locs, kv)
        report["mismatches"] = mismatches
        report["tree_loaded"] = stack.tree_snapshot()
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        report["free_counts"] = (start, (stack.device_available(), stack.host_available()))
        report["empty_tree"] = stack.tree_snapshot()
    return report


CASES = [(cp, layout) for cp in (2, 3) for layout in ("layer_first", "page_first")]


@pytest.fixture(scope="module", params=CASES, ids=[f"cp{cp}-kernel-{lay}" for cp, lay in CASES])
def reports(request) -> List[Dict[str, object]]:
    cp, layout = request.param
    return run_ranks(cp, scenario, layout)


def test_every_backup_is_acked_on_every_rank(reports):
    assert [r["pending_acks"] for r in reports] == [[]] * len(reports)
    assert all(view.host_backed for view in reports[0]["tree_backed_up"])


def test_radix_tree_is_identical_on_every_rank(reports):
    for stage in ("tree_backed_up", "tree_evicted", "tree_loaded"):
        trees = [r[stage] for r in reports]
        assert trees[0], stage
        for rank, tree in enumerate(trees[1:], start=1):
            assert tree == trees[0], f"{stage}: rank {rank} differs from rank 0"
    evicted = reports[0]["tree_evicted"]
    assert all(v.logical_device_locs is None and v.host_backed for v in evicted)


def test_owned_rows_are_byte_exact_after_load_back(reports):
    for rank, report in enumerate(reports):
        assert report["mismatches"] == [], f"rank {rank}"


def test_free_counts_return_after_everything_is_evicted(reports):
    for rank, report in enumerate(reports):
        start, end = report["free_counts"]
        assert end == start, f"rank {rank}: (device, host) free {end} != start {start}"
        assert report["empty_tree"] == (), f"rank {rank}"


# ------------------------------------------------------------------------------------
# A backup of one page: every rank but the owner takes part with nothing to move.
# ------------------------------------------------------------------------------------


def zero_owned_backup(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    with sharded_stack(ctx, StackConfig(), plugin_hooks=False) as stack:
        kv = _logical_kv(stack, _C)
        locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), PAGE)
        owner = int(stack.placement.owner_of(locs[:1]))
        report["owner"], report["owned_rows"] = owner, int(stack.owned_mask(locs).sum())
        write_owned_rows(stack, locs, kv, slice(None))
        stack.insert(_C, locs, base)
        # The owner's copy stays in flight: the MIN all-reduce holds every rank's ack.
        hold = CPU_DEVICE_MODULE.hold_events() if stack.shard_rank == owner else None
        stack.cache.flush_pending_backups()
        if hold is not None:
            hold.seal()
        stack.cache.writing_check()
        report["pending_while_owner_copies"] = sorted(stack.cache.ongoing_write_through)
        if hold is not None:
            hold.release()
        stack.cache.writing_check()
        report["pending_after"] = sorted(stack.cache.ongoing_write_through)
        if report["pending_after"]:
            return report  # unacked: nothing to load back; the main process reports it
        _evict_all(stack)
        report["mismatches"] = owned_row_mismatches(stack, _load_back(stack, _C), kv)
    return report


@pytest.mark.parametrize("cp", [2, 3])
def test_rank_that_owns_no_page_of_a_backup_still_acks(cp):
    reports = run_ranks(cp, zero_owned_backup)
    owner = reports[0]["owner"]
    assert [r["owner"] for r in reports] == [owner] * cp
    assert [r["owned_rows"] for r in reports] == [PAGE if r == owner else 0 for r in range(cp)]
    node_ids = reports[0]["pending_while_owner_copies"]
    assert len(node_ids) == 1, "the in-flight copy should hold the ack on every rank"
    assert [r["pending_while_owner_copies"] for r in reports] == [node_ids] * cp
    assert [r["pending_after"] for r in reports] == [[]] * cp, "a rank never acked"
    assert [r["mismatches"] for r in reports] == [[]] * cp


# ------------------------------------------------------------------------------------
# The gloo stand-in for the pool's gather communicator.
# ------------------------------------------------------------------------------------


def gather_blocks(ctx: RankContext) -> List[int]:
    from sglang_cp_hicache.testing.v0_5_23.shard_group import (
        GlooGatherCommunicator,
        GlooShardGroup,
    )

    group = GlooShardGroup.from_rank_context(ctx)
    comm = GlooGatherCommunicator(group=group.cpu_group, device=group.device)
    block = 3
    scratch = torch.zeros((group.world_size * block, 2), dtype=torch.bfloat16)
    send = scratch[group.rank_in_group * block : (group.rank_in_group + 1) * block]
    send.fill_(group.rank_in_group + 1)
    with comm.change_state(enable=True):
        comm.all_gather(scratch, send)  # in place: send is this rank's block of scratch
    return scratch[:, 0].to(torch.int64).tolist()


def test_gather_communicator_assembles_every_rank_block_in_place():
    gathered = run_ranks(3, gather_blocks)
    assert gathered == [[1, 1, 1, 2, 2, 2, 3, 3, 3]] * 3
