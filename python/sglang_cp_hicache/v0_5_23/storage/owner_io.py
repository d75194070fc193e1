"""Owner writes, owner reads: the L3 side of ``HybridCacheController`` under CP shared KV.

Upstream 0.5.23's storage path assumes every rank holds every page (MLA: one writer, every
rank reads every hit page). Under sharding the logical host slots of an operation are
striped over the CP group (``PageInterleaveHostPool``: logical host page ``h`` lives on rank
``h % N`` at local page ``h // N``). These AROUND hooks narrow each storage operation to the
pages this rank owns, in their physical host rows, and hand that to upstream's own code:

* :func:`generate_storage_config_around`: every CP rank is a writer (the attention-TP rank
  0 of each CP coordinate, not only global TP rank 0);
* :func:`resolve_metrics_collector_around`: the L3 series keep the rank's own ``tp_rank``
  label (the writer rule's config would label every CP rank 0);
* :func:`page_backup_around`: the owner of a page writes it (KV, then upstream's KV-derived
  sidecars, i.e. the DSA indexer; the packed MTP draft rides in the KV page); a rank that
  owns nothing of the backup does no I/O and reports the backup complete, and
  upstream's backup thread acks it like any other;
* :func:`page_transfer_kv_batch_around`: on a prefetch each rank reads only its owned
  pages of a batch and reports the batch's logical progress as its first owned page that
  did not read back whole (every component), or the whole batch
  (``core.storage_keys.logical_pages_completed``). Upstream's completion MIN
  (``_reduce_prefetch_ack``) then yields the prefix every owner read: no new collective;
* :func:`alloc_prefetch_host_buffers_around`: prefetch host slots follow upstream's owner
  rule, cyclic from a start owner decided from replicated state (the anchor's chain
  phase, else, for a root anchor, the base a new extend chain would get:
  :func:`root_chain_start`); an operation with no recorded start owner is a bug and raises
  (:class:`PrefetchStartOwnerMissing`);
* :func:`allocate_storage_hit_around`: when the host is full, the room for a storage hit
  is made lane-aware (``host_lane_eviction``: host leaves on the owner lanes the hit's
  cyclic slots draw from), not by upstream's token-count LRU, whose victim may free
  another lane and drop the whole hit.

The hit query stays upstream's: every rank checks every page and component (cheap
metadata), and the existing hit MIN agrees on one length.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from sglang_cp_hicache.core.lane_eviction import new_chain_base
from sglang_cp_hicache.core.storage_keys import logical_pages_completed
from sglang_cp_hicache.v0_5_23.cache.cache_extension import CpCacheExtension, extension_of
from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import (
    evict_host_for_backup,
    room_for_backup,
)

logger = logging.getLogger(__name__)

# A prefetch's start owner (the extension's ``start_owners``) is recorded by the cache
# (scheduler thread, in ``prefetch_from_storage_around``) right after upstream queues it,
# before its host slots are allocated (on a later scheduler poll, once the hit query is
# acked): the owner class of its first page, or None for a root anchor ("least-full at
# allocation").
_UNRECORDED = object()


class PrefetchStartOwnerMissing(RuntimeError):
    """A sharded prefetch reached host-slot allocation without its recorded start owner:
    an operation built outside ``prefetch_from_storage`` (or that hook bypassed). Picking
    one here from per-call state could place its pages differently on different ranks."""


@dataclass(frozen=True)
class OwnedRun:
    """This rank's share of a page-aligned run of logical host slots.

    ``owned[i]``: whether page ``i`` of the run is this rank's; ``physical_host_indices``:
    the token rows of the owned pages in this rank's host pool, in page order;
    ``owned_hashes``: their page hashes, in the same order.
    """

    owned: Tuple[bool, ...]
    physical_host_indices: torch.Tensor
    owned_hashes: List[str]

    @property
    def owned_pages(self) -> int:
        return len(self.owned_hashes)


def owned_run(
    host_pool: Any, logical_host_indices: torch.Tensor, hashes: List[str], page_size: int
) -> OwnedRun:
    """Narrow ``logical_host_indices`` (``len(hashes)`` whole pages) to this rank's pages.

    ``host_pool``: the ``PageInterleaveHostPool`` the slots come from."""
    if logical_host_indices.numel() != len(hashes) * page_size:
        raise ValueError(
            f"{logical_host_indices.numel()} host slots for {len(hashes)} pages of {page_size}"
        )
    placement, rank = host_pool.placement, host_pool.shard_rank
    page_mask = placement.local_mask(logical_host_indices[::page_size], rank)
    token_mask = placement.local_mask(logical_host_indices, rank)
    owned = tuple(bool(flag) for flag in page_mask.tolist())
    return OwnedRun(
        owned=owned,
        physical_host_indices=placement.local_index(logical_host_indices[token_mask]),
        owned_hashes=[page_hash for page_hash, mine in zip(hashes, owned) if mine],
    )


def _anchor_pool(controller: Any) -> Any:
    return controller.mem_pool_host.anchor_entry.host_pool


def _extension(controller: Any) -> Optional[CpCacheExtension]:
    """The extension of the cache whose sharded KV host pool ``controller`` moves (found
    through the device allocator, which the controller holds from its first line)."""
    if not controller.is_kv_sharded:
        return None
    return extension_of(controller.mem_pool_device_allocator)


# ------------------------------------------------------------------ the writer rule
def generate_storage_config_around(original: Callable, controller: Any, *args, **kwargs):
    """Every CP rank writes the pages it owns: the MLA writer rule (``tp_rank == 0``,
    ``HiCacheStorageConfig.is_storage_writer``) is applied within the attention-TP group,
    so each CP coordinate has exactly one writer."""
    config = original(controller, *args, **kwargs)
    if _extension(controller) is None:
        return config
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return dataclasses.replace(
        config, tp_rank=parallel.attn_tp_rank, tp_size=parallel.attn_tp_size
    )


def resolve_metrics_collector_around(
    original: Callable, attachment: Any, storage_backend: Optional[str], extra_metric_labels: Optional[dict] = None
):
    """A CP rank's L3 series keep the ``tp_rank`` its radix and scheduler series carry (and
    upstream's unsharded CP ranks' L3 series carry): upstream labels them with the storage
    config's ``tp_rank``, which the writer rule above sets to the attention-TP rank (0 on
    every CP rank). The label goes in through upstream's own ``extra_metric_labels``, so the
    collector is built with it (its pre-created per-reason children included), never
    relabelled after. ``attn_cp_rank`` stays upstream's."""
    if _extension(attachment._cache.cache_controller) is None:
        return original(attachment, storage_backend, extra_metric_labels)
    from sglang.srt.layers import dp_attention
    from sglang.srt.observability.metrics_collector import radix_cache_metric_labels
    from sglang.srt.runtime_context import get_parallel

    radix = radix_cache_metric_labels("", get_parallel(), dp_attention.is_dp_attention_enabled())
    return original(attachment, storage_backend, {**(extra_metric_labels or {}), "tp_rank": radix["tp_rank"]})


# ------------------------------------------------------------------------ backup
def page_backup_around(original: Callable, controller: Any, operation: Any) -> None:
    """Write this rank's owned pages of ``operation``; its ``completed_tokens`` becomes the
    logical prefix this rank's writes cover (the whole run when it owns nothing)."""
    if _extension(controller) is None:
        return original(controller, operation)
    page_size = controller.page_size
    run = owned_run(
        _anchor_pool(controller), operation.host_indices, list(operation.hash_value), page_size
    )
    if run.owned_pages == 0:  # nothing to write; never call a backend with no keys
        operation.completed_tokens = len(run.owned) * page_size
        return None
    narrowed = copy.copy(operation)
    narrowed.host_indices = run.physical_host_indices
    narrowed.hash_value = run.owned_hashes
    narrowed.completed_tokens = 0
    # Upstream resolves KV-derived sidecars in place from the op: give it its own copies.
    narrowed.pool_transfers = [
        dataclasses.replace(transfer) for transfer in operation.pool_transfers or []
    ] or operation.pool_transfers
    original(controller, narrowed)
    written = min(narrowed.completed_tokens // page_size, run.owned_pages)
    operation.completed_tokens = logical_pages_completed(run.owned, written) * page_size
    return None


# ---------------------------------------------------------------------- prefetch
def page_transfer_kv_batch_around(
    original: Callable,
    controller: Any,
    operation: Any,
    batch_hashes: List[str],
    batch_host_indices: torch.Tensor,
    extra_info: Any,
    kv_derived_transfers: list,
) -> int:
    """Read this rank's owned pages of one batch (KV and KV-derived sidecars); return the
    batch's logical pages done: the index of the first owned page that did not read back
    whole, or the whole batch (a rank owning none of it does no I/O)."""
    if _extension(controller) is None:
        return original(
            controller, operation, batch_hashes, batch_host_indices, extra_info,
            kv_derived_transfers,
        )  # fmt: skip
    run = owned_run(
        _anchor_pool(controller), batch_host_indices, list(batch_hashes), controller.page_size
    )
    if run.owned_pages == 0:
        return len(batch_hashes)
    read = original(
        controller, operation, run.owned_hashes, run.physical_host_indices, extra_info,
        kv_derived_transfers,
    )  # fmt: skip
    return logical_pages_completed(run.owned, max(0, min(int(read), run.owned_pages)))


def alloc_prefetch_host_buffers_around(
    original: Callable, controller: Any, operation: Any, need_size: int
) -> Optional[torch.Tensor]:
    """Sharded host slots for a storage hit, cyclic from the operation's start owner
    (upstream's sharded host pool refuses an allocation without one)."""
    extension = _extension(controller)
    if extension is None:
        return original(controller, operation, need_size)
    start_owner = extension.start_owners.get(operation, _UNRECORDED)
    if start_owner is _UNRECORDED:
        pool = _anchor_pool(controller)
        raise PrefetchStartOwnerMissing(
            f"cp_hicache: L3 prefetch operation {operation.id} of request "
            f"{operation.request_id} on shard rank {pool.shard_rank}: no start owner was "
            "recorded (prefetch_from_storage_around records one on every operation it "
            "issues); refusing to place its host slots"
        )
    if start_owner is None:
        start_owner = root_chain_start(controller, extension, need_size)
    return controller.mem_pool_host.alloc(need_size, start_owner=int(start_owner))


def root_chain_start(controller: Any, extension: CpCacheExtension, need_tokens: int) -> int:
    """The start owner of a read anchored at the root, which starts a new chain: the rule
    a new extend chain follows (``core.lane_eviction.new_chain_base``: among the lanes
    whose host slots can hold the read's cyclic draws, the one spread furthest from the
    chains this cache's device allocator has started, then the freest; none fitting:
    upstream's least-full class). Replicated state only: the logical host slots and the
    chain counts are identical on every rank."""
    slots = _anchor_pool(controller)._slots
    pages = -(-int(need_tokens) // controller.page_size)
    started = extension.chain_starts.per_base
    return new_chain_base(
        slots.class_free_page_counts(), pages, slots.shard_size, chain_starts=started
    )


def _bound_cache(evict_host: Callable[[int], int]) -> Optional[Any]:
    """The cache ``evict_host`` is bound to (upstream passes ``self.evict_host``), through
    any ``functools.wraps`` wrapper around the bound method (e.g. a timing wrapper)."""
    while evict_host is not None:
        owner = getattr(evict_host, "__self__", None)
        if owner is not None:
            return owner
        evict_host = getattr(evict_host, "__wrapped__", None)
    return None


def allocate_storage_hit_around(
    original: Callable, controller: Any, operation: Any, hit_tokens: int, *,
    evict_host: Callable[[int], int], **kwargs: Any,
) -> Tuple[Optional[torch.Tensor], int]:  # fmt: skip
    """``HybridCacheController.allocate_storage_hit`` (hybrid_cache_controller.py:796-829)
    under sharding: upstream evicts ``hit_tokens`` host tokens by LRU when the slots do not
    fit, retries, then takes the min-lane floor. The slots are drawn cyclically from the
    start owner, so an LRU victim on another lane frees nothing the hit can use and, with
    that lane's floor at 0, the whole hit is dropped. Here the eviction is the backups'
    lane-aware room (``host_lane_eviction.room_for_backup``) for the hit's exact per-lane
    draws; a root anchor's start owner (recorded None) is resolved once, before the first
    allocation, so the room and the slots use the same lanes, and counted as a started
    chain once its slots are held (the next new chain spreads from it). Replicated state
    only."""
    extension = _extension(controller)
    if extension is None:
        return original(controller, operation, hit_tokens, evict_host=evict_host, **kwargs)
    start_owner = extension.start_owners.get(operation, _UNRECORDED)
    if start_owner is _UNRECORDED:  # alloc_prefetch_host_buffers_around raises for it
        return original(controller, operation, hit_tokens, evict_host=evict_host, **kwargs)
    root_anchor = start_owner is None
    if root_anchor:
        start_owner = root_chain_start(controller, extension, hit_tokens)
        extension.start_owners[operation] = start_owner
    cache = _bound_cache(evict_host)
    if cache is None:
        raise RuntimeError(
            "cp_hicache: allocate_storage_hit got an evict_host that is not a bound "
            f"UnifiedRadixCache.evict_host ({evict_host!r}); cannot make lane-aware room"
        )

    def lane_room(num_tokens: int) -> int:
        room = room_for_backup(cache, start_owner, num_tokens, path="storage_hit")
        return evict_host_for_backup(evict_host, room, num_tokens)

    slots, alloc_len = original(controller, operation, hit_tokens, evict_host=lane_room, **kwargs)
    if root_anchor and slots is not None:
        extension.chain_starts.add([int(start_owner)])
    return slots, alloc_len


__all__ = [
    "OwnedRun",
    "PrefetchStartOwnerMissing",
    "alloc_prefetch_host_buffers_around",
    "allocate_storage_hit_around",
    "generate_storage_config_around",
    "owned_run",
    "page_backup_around",
    "page_transfer_kv_batch_around",
    "resolve_metrics_collector_around",
    "root_chain_start",
]
