"""L3 storage on the real 0.5.23 stack: attach a backend, drive backup and prefetch, and
the logical KV the tests write and check (fixtures for ``test_storage_*``).

Every function that drives the cache runs on every rank of the shard group in the same
order (the cache's own collectives pair up across ranks); the extra MIN in
:func:`_all_ranks` is the test's barrier, never product code.

The Mooncake store processes (master, held segment, held writer ranks, free ports) live in
:mod:`~sglang_cp_hicache.testing.v0_5_23.mooncake_store`.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import replace
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.v0_5_23.owned_kv import LogicalKV, logical_kv, write_owned_rows

#: Between two polls of a bounded wait.
POLL_S = 0.01
#: The cache controller's storage threads: one that exited ends every wait on L3 at once.
STORAGE_THREADS = ("prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread", "backup_thread")


def publish_prefill_cp_topology(stack: Any) -> None:
    """Publish a PD prefill worker's topology under prefill CP (TP = the CP group,
    attention TP 1), which the controller's storage config reads."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_rank=stack.shard_rank, tp_size=stack.shard_size, pp_rank=0, pp_size=1,
        attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=stack.shard_rank,
        attn_cp_size=stack.shard_size, attn_dp_rank=0, attn_dp_size=1, attn_dcp_rank=0,
        attn_dcp_size=1, moe_tp_size=stack.shard_size,
    )  # fmt: skip


def attach_storage(
    stack: Any, backend: str, *, model_name: str = "test-model", extra: Optional[dict] = None
) -> Any:
    """Attach ``backend`` to ``stack``'s cache through upstream's controller and publish
    the runtime config, as ``init_hicache`` does at startup; wait-complete prefetches."""
    cache, controller = stack.cache, stack.controller
    threshold = stack.config.page_size
    publish_prefill_cp_topology(stack)
    controller.attach_storage_backend(
        storage_backend=backend,
        prefetch_threshold=threshold,
        model_name=model_name,
        storage_backend_extra_config=dict(extra or {}),
        host_pools=controller.mem_pool_host.entries,
    )
    cache._storage_attachment.apply_runtime_config(
        storage_backend=backend,
        prefetch_threshold=threshold,
        prefetch_timeout_base=30.0,
        prefetch_timeout_per_ki_token=1.0,
        hicache_storage_pass_prefix_keys=False,
        enable_storage=True,
        enable_storage_metrics=False,
        extra_metric_labels=None,
    )
    cache.prefetch_stop_policy = "wait_complete"
    return controller.storage_backend


def attach_at_runtime(stack: Any, backend: str, *, extra: Optional[dict] = None) -> Tuple[bool, str]:
    """Attach ``backend`` as the admin API does (``/attach_hicache_storage_backend``: the
    scheduler's ``attach_hicache_storage_wrapped`` calls
    ``UnifiedRadixCache.attach_storage_backend``, upstream's ``StorageAttachment.attach``),
    ``extra`` as its JSON extra config, wait-complete prefetches; upstream's
    ``(ok, message)``."""
    import json

    publish_prefill_cp_topology(stack)
    config = {
        "prefetch_threshold": stack.config.page_size,
        "prefetch_timeout_base": 30.0,
        "prefetch_timeout_per_ki_token": 1.0,
        **(extra or {}),
    }
    return stack.cache.attach_storage_backend(
        storage_backend=backend,
        storage_backend_extra_config_json=json.dumps(config),
        served_model_name="test-model",
        hicache_storage_prefetch_policy="wait_complete",
    )


def publish_single_rank_flag_record(stack: Any, backend: str) -> Any:
    """Publish, for an unsharded ``stack``, the record of a ``--tp 1`` PD prefill server
    with the plugin's flag and L3 ``backend`` (the stack's own record with the flag, the
    real pipeline's one-prefill-rank step decides its mode); call before :func:`attach_storage`,
    whose backend factory reads it."""
    from sglang_cp_hicache.testing.v0_5_23.stack import publish_server_args

    if stack.sharded:
        raise ValueError("publish_single_rank_flag_record is for an unsharded stack")
    config = replace(stack.config, cp_shared_kv=True)
    return publish_server_args(config, sharded=False, storage_backend=backend)


def detach_storage(stack: Any) -> None:
    stack.cache._storage_attachment.detach()


def l3_budget_s(stack: Any, pages: int) -> float:
    """What upstream allows an L3 transfer of ``pages`` pages on this cache: the attached
    storage's prefetch budget, ``prefetch_timeout_base + pages * prefetch_timeout_per_page``
    (what its ``timeout`` stop policy gives a prefetch; :func:`attach_storage` sets 30 s + 1 s
    per 1,024 tokens). A wait-complete prefetch and a backup have no deadline of their own: a
    test waits that long, which costs time only when the transfer never ends."""
    return stack.cache.prefetch_timeout_base + pages * stack.cache.prefetch_timeout_per_page


def exited_storage_threads(controller: Any) -> List[str]:
    """The controller's storage threads (:data:`STORAGE_THREADS`) started and no longer alive."""
    threads = [(name, getattr(controller, name, None)) for name in STORAGE_THREADS]
    return [name for name, thread in threads if thread is not None and not thread.is_alive()]


def wait_on_all_ranks(stack: Any, what: str, done: Callable[[], bool], budget_s: float) -> float:
    """Poll ``done`` (called on every rank, in step: it may run collectives) until it holds
    on every rank; the seconds it took. Every rank decides alike from one MIN all-reduce
    per poll: ``RuntimeError`` at once when a storage thread exited on any rank (nothing
    can end the wait then), ``TimeoutError`` after ``budget_s``."""
    started = time.monotonic()
    while True:
        finished = done()
        elapsed = time.monotonic() - started
        exited = exited_storage_threads(stack.controller)
        finished, alive, in_time = _all_ranks(stack, finished, not exited, elapsed < budget_s)
        if finished:
            return elapsed
        if not alive:
            threads = ", ".join(exited) if exited else "on another rank"
            raise RuntimeError(f"rank {stack.shard_rank}: {what}: storage thread exited ({threads})")
        if not in_time:
            raise TimeoutError(f"rank {stack.shard_rank}: {what} not done in {budget_s:.1f} s")
        time.sleep(POLL_S)


def _all_ranks(stack: Any, *flags: bool) -> List[bool]:
    """Each flag ANDed over the shard group's ranks (one all-reduce)."""
    if stack.shard_group is None:  # an unsharded stack: one rank
        return list(flags)
    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int)
    torch.distributed.all_reduce(values, torch.distributed.ReduceOp.MIN, group=stack.shard_group.cpu_group)
    return [bool(v) for v in values.tolist()]


def wait_backups_acked_within(stack: Any, timeout_s: float) -> float:
    """Drain until every rank's L3 backup ops are acked; the seconds it took. Raises
    ``TimeoutError`` after ``timeout_s`` (an ack blocked on a dead store)."""

    def acked() -> bool:
        stack.cache.writing_check()
        stack.cache.drain_storage_control_queues()
        return not stack.cache.ongoing_backup

    return wait_on_all_ranks(stack, "L3 backups acked", acked, timeout_s)


def wait_backups_stored(stack: Any, pages: int) -> None:
    """Drain until every rank's L3 backup ops (``pages`` pages) are acked, within
    :func:`l3_budget_s`."""
    wait_backups_acked_within(stack, l3_budget_s(stack, pages))


def prefetch_within(stack: Any, rid: str, token_ids: Sequence[int], timeout_s: float) -> Tuple[int, float]:
    """One L3 prefetch of ``token_ids`` under the root, driven to its end within
    ``timeout_s``: ``(host hit length the tree then holds for it, identical on every rank;
    seconds to the prefetch's end)``."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

    cache, handle = stack.cache, CacheRequestHandle(rid, 0)
    cache.prefetch_from_storage(
        handle, cache.root_node_handle(), array("q", token_ids), None, None,
        matched_prefix_tokens=[],
    )  # fmt: skip

    def finished() -> bool:
        cache.drain_storage_control_queues()
        return cache.check_prefetch_progress(handle)

    elapsed = wait_on_all_ranks(stack, f"prefetch {rid}", finished, timeout_s)
    return int(stack.match(token_ids).host_hit_length), elapsed


def prefetch(stack: Any, rid: str, token_ids: Sequence[int]) -> int:
    """:func:`prefetch_within` :func:`l3_budget_s` of its pages; the host hit length."""
    budget_s = l3_budget_s(stack, len(token_ids) // stack.config.page_size)
    return prefetch_within(stack, rid, token_ids, budget_s)[0]


def request_kv(stack: Any, token_ids: Sequence[int], seed: int) -> LogicalKV:
    """The target's logical KV of the request ``token_ids``, seeded by ``seed`` and the
    request (its first token and length): distinct requests draw distinct bytes."""
    return logical_kv(stack, len(token_ids), stack.config.layer_num, seed + token_ids[0] + len(token_ids))


def store_request(
    stack: Any,
    token_ids: Sequence[int],
    kv: LogicalKV,
    draft: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Extend, write the owned KV (and the MTP draft's ``draft`` rows), insert, back up to
    host and to L3; the logical locs."""
    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(token_ids))
    write_owned_rows(stack, locs, kv)
    if draft is not None:
        write_owned_rows(stack, locs, draft, stack.draft_kv_pool)
    stack.insert(token_ids, locs, base)
    stack.cache.flush_pending_backups()
    wait_backups_stored(stack, len(token_ids) // stack.config.page_size)
    return locs


def evict_everything(stack: Any) -> None:
    """Drop device and host copies so only L3 holds the pages; zero the device rows."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    stack.cache.evict_host(stack.kv_host_pool.logical_size)
    for layer in range(stack.config.layer_num):
        stack.kv_pool.kv_buffer[layer].zero_()
        stack.kv_pool.index_k_with_scale_buffer[layer].zero_()


def load_back(stack: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Load the host hit of ``token_ids`` to device; its logical device locs."""
    match = stack.match(token_ids)
    assert stack.cache.load_back(match.best_match_node)
    stack.cache.ready_to_load_host_cache()
    stack.cache.loading_check()
    match = stack.match(token_ids)
    return stack.cache.path_device_indices(match.last_device_node)


__all__ = [
    "attach_at_runtime",
    "attach_storage",
    "detach_storage",
    "evict_everything",
    "exited_storage_threads",
    "l3_budget_s",
    "load_back",
    "prefetch",
    "prefetch_within",
    "publish_prefill_cp_topology",
    "publish_single_rank_flag_record",
    "request_kv",
    "store_request",
    "wait_backups_acked_within",
    "wait_backups_stored",
    "wait_on_all_ranks",
]
