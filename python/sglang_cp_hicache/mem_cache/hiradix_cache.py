"""``HiRadixCache`` in CP shared-KV mode (installed by REPLACE over SGLang's class).

With a plain allocator this class *is* upstream ``HiRadixCache``: every override defers to
it. With :class:`CPSharedPagedTokenToKVPoolAllocator` it runs CP mode:

* the controller becomes :class:`CpHybridCacheController`, which backs up and loads only
  this rank's owned pages (MLA KV and indexer K/scale) and hands the tree *logical* host
  locs, so every upstream read of ``host_value`` (hit lengths, load-back threshold and
  quota, splits, device-index slicing after load) is logical and rank-invariant;
* host eviction targets the per-lane page deficit of the refused write and counts freed
  lane pages as progress (a node can free zero slots on this rank);
* device eviction for load-back targets the owner lanes the load is short of;
* eviction order breaks priority ties by node id, so all ranks pick the same victims;
* load-back admission counts device-evictable cache in its quota.

None of this adds a collective: the only cross-rank sync stays upstream's MIN all-reduce
of finished write acks in ``writing_check``.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import replace
from typing import Any, Optional

import torch

from sglang.srt.mem_cache import hiradix_cache as _upstream_module
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.mem_cache.common import evict_for_owner_lanes
from sglang_cp_hicache.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.mem_cache.hybrid_cache.cp_hybrid_cache_controller import (
    CpHybridCacheController,
)
from sglang_cp_hicache.server_args import CLI_FLAG, CpSharedKVConfigError

logger = logging.getLogger(__name__)

# Kept in a container: REPLACE rebinds every module-level alias of the original class,
# including one in this module, to the subclass below.
_UPSTREAM = {"HiRadixCache": _upstream_module.HiRadixCache}


class NodeIdTieBreak:
    """Eviction priority with ``node.id`` as tie-break: identical victim order on all ranks."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def get_priority(self, node: TreeNode):
        return (self.strategy.get_priority(node), node.id)

    def __getattr__(self, name: str):
        return getattr(self.strategy, name)


class CpHiRadixCache(_UPSTREAM["HiRadixCache"]):
    """HiRadixCache whose host tier stores only this CP rank's owned KV shards."""

    def __init__(self, params, server_args) -> None:
        allocator = params.token_to_kv_pool_allocator
        self.uses_cp_hicache = isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator)
        if self.uses_cp_hicache:
            _validate_cp_hicache_args(server_args)
        super().__init__(params, server_args)
        if not self.uses_cp_hicache:
            return
        self.layout = allocator.layout
        self.cache_controller = self._build_cp_controller(self.cache_controller)
        self.eviction_strategy = NodeIdTieBreak(self.eviction_strategy)
        logger.info(
            "CP HiCache on rank %d/%d: %d physical host slots per rank, %d logical host tokens",
            self.layout.cp_rank,
            self.layout.cp_size,
            self.token_to_kv_pool_host.size,
            self.cache_controller.host_table.num_logical_pages * self.page_size,
        )

    def _build_cp_controller(self, upstream: Any) -> CpHybridCacheController:
        if not isinstance(self.kv_cache, NSATokenToKVPool):
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} with HiCache needs the NSA KV pool, got {type(self.kv_cache).__name__}"
            )
        # Same arguments as the upstream assembler used; the host pool group is reused.
        controller = CpHybridCacheController(
            upstream.mem_pool_device_allocator,
            upstream.mem_pool_host,
            self.page_size,
            upstream.tp_group,
            load_cache_event=self.load_cache_event,
            attn_cp_group=upstream.attn_cp_group,
            attn_tp_group=upstream.attn_tp_group,
            write_policy=upstream.write_policy,
            io_backend=upstream.io_backend,
            storage_backend=None,
            pp_rank=upstream.pp_rank,
            pp_size=upstream.pp_size,
            transfer_layer_num=upstream.layer_num,
            lane_evictor=self._evict_device_for_lanes,
        )
        return controller

    # ------------------------------------------------------------ host metadata
    def node_host_metadata(self, node: TreeNode) -> Optional[CpHiCacheNodeMetadata]:
        """This rank's host shard of ``node`` (None if the node is not backed up)."""
        if not self.uses_cp_hicache or node.host_value is None or node is self.root_node:
            return None
        return self.cache_controller.host_table.node_metadata(node.host_value, node.id)

    def _split_node(self, key, child: TreeNode, split_len: int):
        before = self.node_host_metadata(child) if self.uses_cp_hicache else None
        new_node = super()._split_node(key, child, split_len)
        if before is not None:
            # Fails fast (node id, rank) if the split cut a page: one physical host page
            # would then back two nodes.
            expected_parent, expected_child = before.split(split_len)
            for node, expected in ((new_node, expected_parent), (child, expected_child)):
                actual = self.node_host_metadata(node)
                if not torch.equal(actual.host_indices, expected.host_indices):
                    raise RuntimeError(
                        f"CP HiCache split of node {child.id} on CP rank "
                        f"{self.layout.cp_rank}: host shards diverged from metadata"
                    )
        return new_node

    # ----------------------------------------------------------------- eviction
    def evict_host(self, num_tokens: int) -> int:
        """Free host cache until every lane short for the last refused write has room.

        Progress is counted in freed lane pages (replicated), not in logical tokens: a node
        can be long yet free nothing on the lane that needs room.
        """
        if not self.uses_cp_hicache:
            return super().evict_host(num_tokens)
        controller: CpHybridCacheController = self.cache_controller
        needed = controller.last_host_deficit.clone()
        if not bool(needed.any()):
            return 0
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_host_leaves]
        heapq.heapify(heap)
        evicted_tokens = 0
        while bool((needed > 0).any()) and heap:
            _, node = heapq.heappop(heap)
            if node is self.root_node or not node.evicted or node.host_ref_counter > 0:
                continue
            self._record_remove_event(node, medium=_upstream_module.StorageMedium.CPU)
            needed -= controller.release_host(node.host_value, node.id)
            evicted_tokens += len(node.host_value)
            parent = node.parent
            parent.children.pop(node.key.child_key(self.page_size), None)
            self.evictable_host_leaves.discard(node)
            self._update_host_leaf_status(parent)
            if not parent.children and parent.evicted and parent is not self.root_node:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
        controller.last_host_deficit.zero_()
        return evicted_tokens

    def _evict_device_for_lanes(self, lane_pages_needed: torch.Tensor) -> None:
        evict_for_owner_lanes(self, lane_pages_needed)

    # ---------------------------------------------------------------- load back
    def init_load_back(self, params: InitLoadBackParams):
        if self.uses_cp_hicache and params.mem_quota is None:
            # Upstream passes no quota; count what eviction could free, not only free slots.
            quota = self.token_to_kv_pool_allocator.available_size() + self.evictable_size()
            params = replace(params, mem_quota=quota)
        return super().init_load_back(params)

    # ----------------------------------------------------------------- storage
    def attach_storage_backend(self, *args, **kwargs):
        if self.uses_cp_hicache:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} does not support attaching a HiCache storage backend"
            )
        return super().attach_storage_backend(*args, **kwargs)

    # ----------------------------------------------------------------- metrics
    def cp_host_usage(self) -> dict:
        """Logical host tokens (identical on all ranks) and this rank's physical slots."""
        return self.cache_controller.host_usage()


def _validate_cp_hicache_args(server_args: Any) -> None:
    if getattr(server_args, "hicache_storage_backend", None) is not None:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} does not support --hicache-storage-backend "
            f"(got {server_args.hicache_storage_backend!r})"
        )
    if getattr(server_args, "enable_hisparse", False):
        raise CpSharedKVConfigError(f"{CLI_FLAG} does not support --enable-hisparse")
