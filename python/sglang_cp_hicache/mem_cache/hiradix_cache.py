"""``HiRadixCache`` in CP shared-KV mode (installed by REPLACE over SGLang's class).

With a plain allocator this class makes upstream ``HiRadixCache``'s decisions (only faster,
see below). With :class:`CPSharedPagedTokenToKVPoolAllocator` it runs CP mode:

* the controller becomes :class:`CpHybridCacheController`, which backs up and loads only
  this rank's owned pages (MLA KV and indexer K/scale) and hands the tree *logical* host
  locs, so every upstream read of ``host_value`` (hit lengths, load-back threshold and
  quota, splits, device-index slicing after load) is logical and rank-invariant;
* host eviction targets the per-lane page deficit of the refused write and counts freed
  lane pages as progress (a node can free zero slots on this rank);
* device eviction for load-back targets the owner lanes the load is short of;
* load-back admission counts device-evictable cache in its quota.

In both modes (hot-path performance, upstream's decisions):

* eviction order breaks priority ties by node id, so all ranks pick the same victims;
* the evictable device and host leaves keep persistent lazy heaps
  (:class:`EvictableLeafSet`), so an eviction call costs O(victims log leaves) instead of
  a heap rebuild over all leaves, with exactly the victims a rebuild would pick; the
  victims' slots go back in one free per call (device: the pages of one free group;
  host: the same free list as one free per node);
* load-back locks the cached ancestors once (upstream walks them three times);
* tree walks (match, insert, host insert) read the clock once per call, not per node:
  every node a call touches gets the same access time, as in base ``RadixCache``;
* ``writing_check`` all-reduces its finished-ack count in one persistent tensor, and
  reads that count from a :class:`WriteAckWatcher`, whose thread polls unfinished write
  events off the scheduler thread (still one MIN all-reduce, acks still pop in order).

None of this adds a collective: the only cross-rank sync stays upstream's MIN all-reduce
of finished write acks in ``writing_check``.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing, contextmanager
from typing import Any, Iterator, List, Optional

import torch

from sglang.srt.mem_cache import hiradix_cache as _upstream_module
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
)
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values

from sglang_cp_hicache.mem_cache.common import evict_for_owner_lanes
from sglang_cp_hicache.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_hicache.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.mem_cache.eviction_heap import EvictableLeafSet, keys_never_decrease
from sglang_cp_hicache.mem_cache.hybrid_cache.cp_hybrid_cache_controller import (
    CpHybridCacheController,
)
from sglang_cp_hicache.mem_cache.write_ack_watcher import WriteAckWatcher
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
        # Finished write acks on this rank, MIN-reduced in place across the attention groups.
        self._write_ack_count = torch.zeros((), dtype=torch.int32)
        self._write_acks = WriteAckWatcher()  # before super(): its __init__ calls reset()
        self._device_frees: Optional[List[torch.Tensor]] = None  # set while evict() batches
        super().__init__(params, server_args)
        self.eviction_strategy = NodeIdTieBreak(self.eviction_strategy)
        self._install_leaf_heaps()
        if not self.uses_cp_hicache:
            return
        self.layout = allocator.layout
        self.cache_controller = self._build_cp_controller(self.cache_controller)
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

    def _install_leaf_heaps(self) -> None:
        """Swap the (still empty) leaf sets for heap-keeping ones; reset() clears them."""
        strategy = self.eviction_strategy.strategy  # the sets break ties by node id too
        grow = keys_never_decrease(strategy)
        self.evictable_leaves = EvictableLeafSet(strategy.get_priority, grow)
        self.evictable_host_leaves = EvictableLeafSet(strategy.get_priority, grow)

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

    # -------------------------------------------------------------- tree walks
    # Upstream's walks, reading the clock once per call. Children are looked up with
    # ``dict.get``: ``TreeNode.children`` is a defaultdict, and indexing a missing key
    # would create a ghost child (and bump the node id counter on this rank only).
    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        now = time.monotonic()
        node.last_access_time = now
        values = []
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len < len(child.key):
                node = self._split_node(child.key, child, prefix_len)
                if not node.evicted:
                    values.append(node.value)
                break
            if not child.evicted:
                values.append(child.value)
            node, key = child, key[prefix_len:]
        return values, node

    def insert(self, params: InsertParams) -> InsertResult:
        priority = params.priority or 0
        key, value = params.key.maybe_to_bigram_view(self.is_eagle, params.value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        if len(key) == 0:
            return InsertResult(prefix_len=0)
        now = time.monotonic()
        node, cached_len = self.root_node, 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len < len(child.key):
                child = self._split_node(child.key, child, prefix_len)
                child.priority = max(child.priority, priority)
            if child.evicted:
                # Recomputed KV of a device-evicted node takes its place again.
                self._revive_on_device(child, value[:prefix_len])
            else:
                self._inc_hit_count(child, params.chunked)
                cached_len += prefix_len
            node = child
            key, value = key[prefix_len:], value[prefix_len:]
        if len(key):
            self._add_device_leaf(node, key, value, priority, params.chunked)
        return InsertResult(prefix_len=cached_len)

    def _revive_on_device(self, node: TreeNode, value: torch.Tensor) -> None:
        node.value = value.clone()
        self.evictable_size_ += len(node.value)
        self._update_leaf_status(node)
        self._update_host_leaf_status(node)
        self._update_leaf_status(node.parent)

    def _add_device_leaf(
        self, parent: TreeNode, key: RadixKey, value: torch.Tensor, priority: int, chunked: bool
    ) -> None:
        leaf = TreeNode(priority=priority)
        leaf.parent, leaf.key, leaf.value = parent, key, value.clone()
        parent.children[key.child_key(self.page_size)] = leaf
        self.evictable_size_ += len(value)
        self._update_leaf_status(parent)
        self._update_leaf_status(leaf)
        if self.enable_storage or self.enable_kv_cache_events:
            leaf.hash_value = compute_node_hash_values(leaf, self.page_size)
        self._record_store_event(leaf)
        if self.cache_controller.write_policy != "write_back":
            self._inc_hit_count(leaf, chunked)

    def _insert_helper_host(self, node: TreeNode, key: RadixKey, host_value, hash_value):
        now = time.monotonic()
        node.last_access_time = now
        matched = 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            child.last_access_time = now
            prefix_len = child.key.match(key, page_size=self.page_size)
            key, host_value = key[prefix_len:], host_value[prefix_len:]
            hash_value = hash_value[prefix_len // self.page_size :]
            matched += prefix_len
            if prefix_len < len(child.key):
                child = self._split_node(child.key, child, prefix_len)
            node = child
        if len(key):
            leaf = TreeNode(priority=node.priority)
            leaf.parent, leaf.key, leaf.value = node, key, None
            leaf.host_value, leaf.hash_value = host_value.clone(), hash_value
            node.children[key.child_key(self.page_size)] = leaf
            self._update_host_leaf_status(leaf)
            self._update_leaf_status(node)
            self._update_host_leaf_status(node)
            self._record_store_event(leaf, medium=_upstream_module.StorageMedium.CPU)
        return matched

    # ----------------------------------------------------------------- eviction
    def evict(self, params: EvictParams) -> EvictResult:
        """Upstream's device eviction, with victims drawn from the persistent leaf heap."""
        if self.cache_controller.write_policy == "write_back":
            # Write-back also evicts parents of nodes whose host write is still in
            # flight; those are not leaves yet, so only upstream's local heap has them.
            return super().evict(params)
        start_time = time.perf_counter()
        evicted = 0
        # Every device leaf is unlocked: inc_lock_ref takes locked nodes out of the set.
        victims = self.evictable_leaves.victims()
        with self._batched_device_frees(), closing(victims):
            while evicted < params.num_tokens:
                node = next(victims, None)
                if node is None:
                    break
                if node.backuped:
                    evicted += self._evict_backuped(node)
                else:
                    evicted += self._evict_regular(node)
        self.update_eviction_metrics(evicted, start_time)
        return EvictResult(num_tokens_evicted=evicted)

    @contextmanager
    def _batched_device_frees(self) -> Iterator[None]:
        """Device slots of the nodes evicted inside go back in one free, in victim order:
        the pages one free group would return, for one allocator call instead of one per
        node."""
        self._device_frees = []
        try:
            yield
        finally:
            frees, self._device_frees = self._device_frees, None
            if frees:
                self.cache_controller.evict_device(torch.cat(frees))

    def _evict_backuped(self, node: TreeNode) -> int:
        if self._device_frees is None:
            return super()._evict_backuped(node)
        # Upstream's demotion to host-only, its free deferred to the batch.
        self._device_frees.append(node.value)
        self._record_remove_event(node, medium=_upstream_module.StorageMedium.GPU)
        num_tokens = len(node.key)  # == len(node.value) on device
        self.evictable_size_ -= num_tokens
        node.value = None
        self.evictable_leaves.discard(node)  # what _update_leaf_status does for it now
        self._update_host_leaf_status(node)
        self._update_leaf_status(node.parent)
        return num_tokens

    def _evict_regular(self, node: TreeNode) -> int:
        if self._device_frees is None:
            return super()._evict_regular(node)
        # Upstream's removal of a leaf never backed up, its free deferred to the batch.
        self._device_frees.append(node.value)
        self._record_remove_event(node)
        self._delete_leaf(node)
        return len(node.key)

    def evict_host(self, num_tokens: int) -> int:
        """Free host-only leaves (LRU); return the logical tokens freed.

        In CP mode, free until every lane short for the last refused write has room.
        Progress is then counted in freed lane pages (replicated), not in logical tokens:
        a node can be long yet free nothing on the lane that needs room.
        """
        if self.uses_cp_hicache:
            return self._evict_host_for_lane_deficit()
        freed = []
        evicted = 0
        with closing(self.evictable_host_leaves.victims(_host_evictable)) as victims:
            while evicted < num_tokens:
                node = next(victims, None)
                if node is None:
                    break
                self._detach_host_leaf(node)
                freed.append(node.host_value)
                evicted += len(node.host_value)
        if freed:
            # One free, in victim order: the host free list ends up as with one per node,
            # for one O(free list) copy instead of one per node.
            self.cache_controller.evict_host(torch.cat(freed))
        return evicted

    def _evict_host_for_lane_deficit(self) -> int:
        controller: CpHybridCacheController = self.cache_controller
        needed = controller.last_host_deficit.numpy().copy()
        controller.last_host_deficit.zero_()
        evicted = 0
        victims = self.evictable_host_leaves.victims(_host_evictable)
        with controller.batched_host_frees(), closing(victims):
            while (needed > 0).any():
                node = next(victims, None)
                if node is None:
                    break
                self._detach_host_leaf(node)
                needed -= controller.release_host(node.host_value, node.id).numpy()
                evicted += len(node.host_value)
        return evicted

    def _detach_host_leaf(self, node: TreeNode) -> None:
        """Unlink a host-only leaf; its parent may become a host leaf (and a victim of the
        same call). The caller frees its host slots."""
        self._record_remove_event(node, medium=_upstream_module.StorageMedium.CPU)
        parent = node.parent
        parent.children.pop(node.key.child_key(self.page_size), None)
        self.evictable_host_leaves.discard(node)
        self._update_host_leaf_status(parent)

    def _evict_device_for_lanes(self, lane_pages_needed: torch.Tensor) -> None:
        evict_for_owner_lanes(self, lane_pages_needed)

    # --------------------------------------------------------------- write acks
    def writing_check(self, write_back: bool = False) -> None:
        """Pop, in order, the write acks finished on every rank (upstream's MIN all-reduce)."""
        if write_back:
            super().writing_check(write_back=True)
            self._write_acks.stop()  # that blocking drain emptied the ack queue
            return
        # ongoing_write_through is replicated: every rank skips the collective alike.
        if not self.ongoing_write_through:
            return
        finished = self._write_acks.sync(self.cache_controller.ack_write_queue)
        self._write_ack_count.fill_(finished)
        self._all_reduce_attn_groups(self._write_ack_count, torch.distributed.ReduceOp.MIN)
        count = int(self._write_ack_count.item())
        self._pop_write_acks(count)
        self._write_acks.consume(count)

    def _pop_write_acks(self, count: int) -> None:
        """Complete the first ``count`` write acks: their nodes are now backed up on host."""
        acks = self.cache_controller.ack_write_queue
        for ack in acks[:count]:
            ack.finish_event.synchronize()
            for node_id in ack.node_ids:
                node = self.ongoing_write_through.pop(node_id)
                self._record_store_event(node, medium=_upstream_module.StorageMedium.CPU)
                self.dec_lock_ref(node)
                if self.enable_storage:
                    self.write_backup_storage(node)
        del acks[:count]

    # ---------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        self._write_acks.stop()  # the controller's reset drops every queued ack
        super().reset()

    def shutdown(self) -> None:
        super().shutdown()
        self._write_acks.stop()

    # ---------------------------------------------------------------- load back
    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        """Upstream's load-back with one lock walk over the cached ancestors, not three.

        Upstream locks the ancestors for the load, unlocks them, then locks the path from
        the hit node to the root; the ancestors end with one extra reference either way,
        so they keep the first one and only the loaded nodes are locked afterwards. Same
        checks, events, metrics and final tree state as upstream. In CP mode a missing
        quota becomes free plus device-evictable slots.
        """
        start_time = time.perf_counter()
        if self.uses_cp_hicache and mem_quota is None:
            # Upstream passes no quota; count what eviction could free, not only free slots.
            mem_quota = self.token_to_kv_pool_allocator.available_size() + self.evictable_size()
        hit_node = node
        nodes_to_load: List[TreeNode] = []
        while node.evicted:
            assert node.backuped, "No backup available on evicted nodes, should not happen"
            nodes_to_load.append(node)
            node = node.parent
        nodes_to_load.reverse()
        cached_ancestor = node
        delta = self.inc_lock_ref(cached_ancestor).delta  # held through the load

        if len(nodes_to_load) == 1:  # the usual case; load() only reads host_indices
            host_indices = nodes_to_load[0].host_value
        else:
            host_indices = torch.cat([n.host_value for n in nodes_to_load])
        too_short = len(host_indices) < self.load_back_threshold
        # delta <= 0: the ancestors just locked are no longer evictable.
        over_quota = mem_quota is not None and len(host_indices) > mem_quota + delta
        if too_short or over_quota:
            self.dec_lock_ref(cached_ancestor)
            return None

        extra_pools = self._get_extra_pools()
        device_indices = self.cache_controller.load(
            host_indices=host_indices, node_id=hit_node.id, **extra_pools
        )
        if device_indices is None:
            self.evict(EvictParams(num_tokens=len(host_indices)))
            device_indices = self.cache_controller.load(
                host_indices=host_indices, node_id=hit_node.id, **extra_pools
            )
        if device_indices is None:
            self.dec_lock_ref(cached_ancestor)
            logger.warning(
                "load_back: FAILED to load %d tokens for node %d even after eviction "
                "(evictable_size=%d)",
                len(host_indices),
                hit_node.id,
                self.evictable_size_,
            )
            return None

        self.ongoing_load_back[hit_node.id] = hit_node
        offset = 0
        for loaded in nodes_to_load:
            loaded.value = device_indices[offset : offset + len(loaded.host_value)].clone()
            offset += len(loaded.host_value)
            self._record_store_event(loaded, medium=_upstream_module.StorageMedium.GPU)
        self.evictable_size_ += len(device_indices)
        self._lock_path(hit_node, cached_ancestor)

        if self.metrics_collector is not None:
            self.metrics_collector.observe_load_back_duration(time.perf_counter() - start_time)
            self.metrics_collector.increment_load_back_num_tokens(len(device_indices))
        return device_indices

    def _lock_path(self, node: TreeNode, stop: TreeNode) -> None:
        """``inc_lock_ref`` on the nodes from ``node`` up to, not including, ``stop``."""
        while node is not stop:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            self._update_leaf_status(node)
            self._update_host_leaf_status(node)
            node = node.parent

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


def _host_evictable(node: TreeNode) -> bool:
    # Device leaves are never host victims; a prefetch or storage backup may hold a node.
    return node.evicted and node.host_ref_counter == 0


def _validate_cp_hicache_args(server_args: Any) -> None:
    if getattr(server_args, "hicache_storage_backend", None) is not None:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} does not support --hicache-storage-backend "
            f"(got {server_args.hicache_storage_backend!r})"
        )
    if getattr(server_args, "enable_hisparse", False):
        raise CpSharedKVConfigError(f"{CLI_FLAG} does not support --enable-hisparse")
