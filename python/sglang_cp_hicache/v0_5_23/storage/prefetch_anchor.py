"""``UnifiedRadixCache.prefetch_from_storage`` under CP shared KV: where an L3 prefetch
may be anchored, and which owner its pages start at.

AROUND ``prefetch_from_storage`` (scheduler thread, identical on every rank):

* **Anchor rule.** The scheduler chains the prefetch's page hashes from the deepest
  backed-up node (``last_host_node``) but starts its tokens after the whole device + host
  match. When the match runs below that node, through nodes whose backup is still pending
  (not yet acked), the keys would describe no real sequence and the fetched pages would be
  inserted at the wrong depth. Such a prefetch is not issued (counted in the cache's
  extension, ``anchor_skips``); the request computes those tokens, and its later backup
  writes them.
* **Start owner.** The fetched pages continue the anchor's rotation chain when it has one
  (the owner class of the page after the anchor), so the host slots, and the device rows
  a later load-back draws from them, keep the chain's owner cycle; a root anchor records
  None and gets the least-full owner class at allocation. Recorded for every operation
  this hook issues (the extension's ``start_owners``, weakly by operation), right after upstream queues it and before any allocation (which happens on
  a later scheduler poll, once the hit query is acked, in this same thread), for
  ``alloc_prefetch_host_buffers_around``, which raises for an operation without one.

Flag off or unsharded: upstream's method, unchanged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from sglang_cp_hicache.core.rotation import OwnerLane, base_for, owner_of
from sglang_cp_hicache.v0_5_23.cache.cache_extension import host_extension_of

logger = logging.getLogger(__name__)


def anchor_depth_tokens(cache: Any, node_id: Any) -> int:
    """Tokens from the root through ``node_id`` (logical, identical on every rank)."""
    node = cache.tree_core.node_by_id(node_id)
    depth = 0
    while node is not None:
        depth += len(node.key)
        node = node.parent
    return depth


def next_page_owner(cache: Any, node_id: Any, depth_tokens: int) -> Optional[OwnerLane]:
    """The owner class of the page after ``node_id`` on its rotation chain, or None when
    the node starts no chain (the root)."""
    base = cache.tree_core.rotation_base_of(node_id)
    if base is None:
        return None
    shard_size = cache.cache_controller.mem_pool_host.anchor_entry.host_pool.shard_size
    return owner_of(base, depth_tokens // cache.page_size, shard_size)


def prefetch_from_storage_around(
    original: Callable, cache: Any, request: Any, last_host_node_id: Any, *args, **kwargs
) -> Optional[bool]:
    extension = host_extension_of(cache)
    if extension is None:
        return original(cache, request, last_host_node_id, *args, **kwargs)
    matched = kwargs.get("matched_prefix_tokens")
    depth = anchor_depth_tokens(cache, last_host_node_id)
    if matched is not None and len(matched) > depth:
        extension.anchor_skips += 1
        logger.debug(
            "cp_hicache: L3 prefetch of %s not issued: the match (%d tokens) runs below "
            "its anchor (%d tokens) through a pending backup",
            request.rid,
            len(matched),
            depth,
        )
        return None
    result = original(cache, request, last_host_node_id, *args, **kwargs)
    info = cache.ongoing_prefetch.get(request)
    if info is not None:
        start_owner = next_page_owner(cache, last_host_node_id, depth)
        extension.start_owners[info.operation] = start_owner
    return result


def handle_prefetch_result_around(original: Callable, cache: Any, operation: Any) -> Any:
    """The fetched pages become host nodes under the prefetch's anchor (upstream's
    ``insert_host``), which gives a new node no rotation base: after a load-back such a
    node would be a device prefix no sharded extend can continue (``allocation.py:
    _kv_shard_rotation_bases`` asserts). Each new node on the fetched path gets the base of
    the chain its host slots were drawn on: owner of its first host page minus its
    position-page (the load-back keeps host owners; replicated state, every rank alike)."""
    extension = host_extension_of(cache)
    if extension is None:
        return original(cache, operation)
    info = cache.ongoing_prefetch.get(operation.handle)
    result = original(cache, operation)
    if info is not None:
        _set_fetched_rotation_bases(cache, info.anchor_node_id, info.prefetch_key)
    return result


def _set_fetched_rotation_bases(cache: Any, anchor_id: Any, fetched_key: Any) -> None:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    host_pool = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    node = cache.tree_core.node_by_id(anchor_id)
    depth, key, page = anchor_depth_tokens(cache, anchor_id), fetched_key, cache.page_size
    while node is not None and len(key) > 0:
        node = node.children.get(key.child_key(page))
        if node is None:
            return
        host_value = node.component_data[ComponentType.FULL].host_value
        if node.rotation_base is None and host_value is not None and len(host_value):
            owner = int(host_pool.placement.owner_of(host_value[:1].to(torch.int64))[0])
            node.rotation_base = base_for(owner, depth // page, host_pool.shard_size)
        depth += len(node.key)
        key = key[len(node.key) :]


__all__ = [
    "anchor_depth_tokens",
    "handle_prefetch_result_around",
    "next_page_owner",
    "prefetch_from_storage_around",
]
