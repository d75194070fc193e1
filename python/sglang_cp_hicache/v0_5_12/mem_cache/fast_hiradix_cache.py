"""``HiRadixCache`` with hot-path speedups and two upstream fixes; runs with the flag off.

What differs from upstream ``HiRadixCache`` 0.5.12.post1 when
``--enable-nsa-prefill-cp-shared-kv`` is off (:class:`CpHiRadixCache` adds only CP deltas):

Same decisions, faster:

* eviction order breaks priority ties by node id, so all ranks pick the same victims
  (upstream falls back to per-process set order on equal timestamps);
* the evictable device and host leaves keep persistent lazy priority queues
  (:class:`EvictableLeafSet`: a sorted run for leaves that arrive in LRU order, a heap for
  the rest), so an eviction call costs at most O(victims log leaves) instead of a heap
  rebuild over all leaves, with exactly the victims a rebuild would pick; the
  victims' slots go back in one free per call (device: the pages of one free group;
  host: the same free list as one free per node);
* load-back locks the cached ancestors once (upstream walks them three times);
* tree walks (match, insert, host insert) read the clock once per call, not per node:
  every node a call touches gets the same access time, as in base ``RadixCache``;
* ``writing_check`` all-reduces its finished-ack count in one persistent tensor, and
  reads that count from a :class:`WriteAckWatcher`, whose thread polls unfinished write
  events off the scheduler thread (still one MIN all-reduce, acks still pop in order).

Fixed:

* the nodes a load-back reads stay protected from host eviction for the whole load, so
  an eviction the load needs (``write_back`` backs up device victims, which may evict
  host leaves) can never free the host pages being loaded;
* a node split while its write-through is pending publishes the stored-block event of
  both fragments on its ack (upstream only the suffix's).

None of this adds a collective: the only cross-rank sync stays upstream's MIN all-reduce
of finished write acks in ``writing_check``.
"""

from __future__ import annotations

import time
from contextlib import closing, contextmanager
from typing import Any, Dict, Iterator, List, Optional, Set

import torch

from sglang.srt.mem_cache import hiradix_cache as _upstream_module
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import compute_node_hash_values

from sglang_cp_hicache.v0_5_12.mem_cache.eviction_heap import EvictableLeafSet, keys_never_decrease
from sglang_cp_hicache.core.write_ack_watcher import WriteAckWatcher

logger = _upstream_module.logger

# Kept in a container: REPLACE rebinds every module-level alias of the original class,
# including one in this module, to the plugin's subclass.
UPSTREAM = {"HiRadixCache": _upstream_module.HiRadixCache}
CPU = _upstream_module.StorageMedium.CPU
GPU = _upstream_module.StorageMedium.GPU


class NodeIdTieBreak:
    """Eviction priority with ``node.id`` as tie-break: identical victim order on all ranks."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def get_priority(self, node: TreeNode):
        return (self.strategy.get_priority(node), node.id)

    def __getattr__(self, name: str):
        return getattr(self.strategy, name)


def host_evictable(node: TreeNode) -> bool:
    """A host leaf that may lose its host copy: not on device (device leaves are never host
    victims), not protected (a load reading it, a prefetch or storage backup)."""
    return node.evicted and node.host_ref_counter == 0


class FastHiRadixCache(UPSTREAM["HiRadixCache"]):
    """Upstream ``HiRadixCache`` decisions with the speedups and fixes listed above."""

    def __init__(self, params, server_args) -> None:
        # Finished write acks on this rank, MIN-reduced in place across the attention groups.
        self._write_ack_count = torch.zeros((), dtype=torch.int32)
        self._write_acks = WriteAckWatcher()  # before super(): its __init__ calls reset()
        self._device_frees: Optional[List[torch.Tensor]] = None  # set while evict() batches
        # Fragments split off a node whose write-through is pending, by that node's id.
        self._pending_fragments: Dict[int, List[TreeNode]] = {}
        # Requests (by rid) whose match this round stopped short of a deferred split.
        self._split_deferrals: Set[str] = set()
        self._match_deferred = False
        super().__init__(params, server_args)
        self.eviction_strategy = NodeIdTieBreak(self.eviction_strategy)
        self._install_leaf_heaps()

    def _install_leaf_heaps(self) -> None:
        """Swap the (still empty) leaf sets for heap-keeping ones; reset() clears them."""
        strategy = self.eviction_strategy.strategy  # the sets break ties by node id too
        grow = keys_never_decrease(strategy)
        self.evictable_leaves = EvictableLeafSet(strategy.get_priority, grow)
        self.evictable_host_leaves = EvictableLeafSet(strategy.get_priority, grow)

    # ------------------------------------------------------------------ splits
    def _split_node(self, key, child: TreeNode, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        pending_id = self._pending_write_id(child)
        if pending_id is not None:
            self._pending_fragments.setdefault(pending_id, []).append(new_node)
        return new_node

    def _pending_write_id(self, node: TreeNode) -> Optional[int]:
        """Id of the pending write-through ``node`` belongs to (itself or a fragment of it)."""
        if node.id in self.ongoing_write_through:
            return node.id
        for pending_id, fragments in self._pending_fragments.items():
            if any(fragment is node for fragment in fragments):
                return pending_id
        return None

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
                if self._defers_split(child):
                    break  # the match ends above ``child``; the scheduler defers the request
                node = self._split_node(child.key, child, prefix_len)
                if not node.evicted:
                    values.append(node.value)
                break
            if not child.evicted:
                values.append(child.value)
            node, key = child, key[prefix_len:]
        return values, node

    def _defers_split(self, node: TreeNode) -> bool:
        """Whether a match must not split ``node`` now (upstream splits anything)."""
        return False

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Upstream's match; a request whose match would split a node that must not be split
        now is remembered for :meth:`take_split_deferral` (this scheduling round only)."""
        self._match_deferred = False
        result = super().match_prefix(params)
        if self._match_deferred and params.req is not None:
            self._split_deferrals.add(params.req.rid)
        return result

    def take_split_deferral(self, req: Any) -> bool:
        """True once if ``req``'s last match stopped short of a split that must wait: the
        scheduler then leaves it waiting for this round (it holds no lock yet)."""
        if req.rid not in self._split_deferrals:
            return False
        self._split_deferrals.discard(req.rid)
        return True

    def insert(self, params: InsertParams) -> InsertResult:
        priority = params.priority or 0
        key, value = params.key.maybe_to_bigram_view(self.is_eagle, params.value)
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        if len(key) == 0:
            return InsertResult(prefix_len=0)
        now = time.monotonic()
        node, cached_len, start = self.root_node, 0, 0  # start: offset of key in the value
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
                self._revive_on_device(child, value[:prefix_len], start)
            else:
                self._inc_hit_count(child, params.chunked)
                cached_len += prefix_len
            node = child
            key, value = key[prefix_len:], value[prefix_len:]
            start += prefix_len
        if len(key):
            self._add_device_leaf(node, key, value, priority, params.chunked, start)
        return InsertResult(prefix_len=cached_len)

    def _inc_hit_count(self, node: TreeNode, chunked: bool = False) -> None:
        """Upstream's write-through trigger, plus chunked prefill: upstream counts no hit
        for a chunked request (its own re-inserts would inflate the count), so a long
        chunked prompt never reached host. Each completed chunk is backed up once instead,
        so the prompt comes back from host after a device eviction."""
        if chunked and self.cache_controller.write_policy != "write_back":
            if not node.backuped:
                self.write_backup(node)
            return
        super()._inc_hit_count(node, chunked)

    def _revive_on_device(self, node: TreeNode, value: torch.Tensor, start: int) -> None:
        node.value = value.clone()
        self._on_device_value(node, start)
        self.evictable_size_ += len(node.value)
        self._update_leaf_status(node)
        self._update_host_leaf_status(node)
        self._update_leaf_status(node.parent)

    def _add_device_leaf(
        self,
        parent: TreeNode,
        key: RadixKey,
        value: torch.Tensor,
        priority: int,
        chunked: bool,
        start: int,
    ) -> None:
        leaf = TreeNode(priority=priority)
        leaf.parent, leaf.key, leaf.value = parent, key, value.clone()
        self._on_device_value(leaf, start)
        parent.children[key.child_key(self.page_size)] = leaf
        self.evictable_size_ += len(value)
        self._update_leaf_status(parent)
        self._update_leaf_status(leaf)
        if self.enable_storage or self.enable_kv_cache_events:
            leaf.hash_value = compute_node_hash_values(leaf, self.page_size)
        self._record_store_event(leaf)
        if self.cache_controller.write_policy != "write_back":
            self._inc_hit_count(leaf, chunked)

    def _on_device_value(self, node: TreeNode, start: int) -> None:
        """``node.value`` was just set to ``[start, start + len(node.value))`` of the value
        being placed (an insert's value, a load-back's new locs); subclasses derive state."""

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
            self._record_store_event(leaf, medium=CPU)
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
                evicted += self._evict_device_node(node)
        self.update_eviction_metrics(evicted, start_time)
        return EvictResult(num_tokens_evicted=evicted)

    def _evict_device_node(self, node: TreeNode) -> int:
        """Demote a backed-up device leaf to host, or drop one never backed up."""
        if node.backuped:
            return self._evict_backuped(node)
        return self._evict_regular(node)

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
                self.cache_controller.evict_device(self._page_representatives(torch.cat(frees)))

    def _page_representatives(self, device_locs: torch.Tensor) -> torch.Tensor:
        """One loc per page of ``device_locs``, the device values of whole radix nodes.

        Radix nodes hold whole pages (keys are page-aligned, splits fall on page
        boundaries, and the paged allocator puts position ``p`` at page offset
        ``p % page_size``), so each page's first loc stands for the page: the allocator's
        free (``unique(locs // page_size)``) then sorts pages, not every token of them.
        """
        if self.page_size == 1 or len(device_locs) % self.page_size:
            return device_locs
        return device_locs[:: self.page_size]

    def _evict_backuped(self, node: TreeNode) -> int:
        if self._device_frees is None:
            return super()._evict_backuped(node)
        # Upstream's demotion to host-only, its free deferred to the batch.
        self._device_frees.append(node.value)
        self._record_remove_event(node, medium=GPU)
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
        """Free host-only leaves (LRU); return the logical tokens freed."""
        freed = []
        evicted = 0
        with closing(self.evictable_host_leaves.victims(host_evictable)) as victims:
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

    def _detach_host_leaf(self, node: TreeNode) -> None:
        """Unlink a host-only leaf; its parent may become a host leaf (and a victim of the
        same call). The caller frees its host slots."""
        self._record_remove_event(node, medium=CPU)
        parent = node.parent
        parent.children.pop(node.key.child_key(self.page_size), None)
        self.evictable_host_leaves.discard(node)
        self._update_host_leaf_status(parent)

    # --------------------------------------------------------------- write acks
    def writing_check(self, write_back: bool = False) -> None:
        """Pop, in order, the write acks finished on every rank (upstream's MIN all-reduce).

        Outside write-back it also ends the split deferrals of the last round: the
        scheduler's per-round poll (``check_hicache_events``) runs it first, and its only
        other caller (``flush_write_through_acks``, decode) runs after that round's
        admissions, where no deferral can be taken any more. Here rather than in an
        override of ``check_hicache_events``: no frame of ours on the idle poll."""
        if write_back:
            # Upstream blocks until every write-back has landed; no collective.
            acks = self.cache_controller.ack_write_queue
            for ack in acks:
                ack.finish_event.synchronize()
                for node_id in ack.node_ids:
                    self._publish_backup(node_id)
            acks.clear()
            self._write_acks.stop()  # the queue it tracked is gone
            return
        if self._split_deferrals:  # usually empty
            self._split_deferrals.clear()
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
                node = self._publish_backup(node_id)
                if node is not None:  # None: an ack that completes no locked node yet
                    self.dec_lock_ref(node)
        del acks[:count]

    def _publish_backup(self, node_id: int) -> Optional[TreeNode]:
        """The write of ``node_id`` landed: its node and every fragment split off it while
        it was pending are on host (stored-block events, storage backup)."""
        node = self.ongoing_write_through.pop(node_id)
        for backed_up in (*self._pending_fragments.pop(node_id, ()), node):
            self._record_store_event(backed_up, medium=CPU)
            if self.enable_storage:
                self.write_backup_storage(backed_up)
        return node

    # ---------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        self._write_acks.stop()  # the controller's reset drops every queued ack
        self._pending_fragments.clear()
        self._split_deferrals.clear()
        super().reset()

    def shutdown(self) -> None:
        super().shutdown()
        self._write_acks.stop()

    # ---------------------------------------------------------------- load back
    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        """Upstream's load-back with one lock walk over the cached ancestors, not three,
        and the loaded nodes protected from host eviction until their host pages are read.

        Upstream locks the ancestors for the load, unlocks them, then locks the path from
        the hit node to the root; the ancestors end with one extra reference either way,
        so they keep the first one and only the loaded nodes are locked afterwards. Same
        checks, events, metrics and final tree state as upstream.
        """
        start_time = time.perf_counter()
        hit_node = node
        nodes_to_load: List[TreeNode] = []
        while node.evicted:
            assert node.backuped, "No backup available on evicted nodes, should not happen"
            nodes_to_load.append(node)
            node = node.parent
        nodes_to_load.reverse()
        cached_ancestor = node
        delta = self.inc_lock_ref(cached_ancestor).delta  # held through the load
        for loaded in nodes_to_load:
            loaded.protect_host()
        try:
            device_indices = self._load_nodes(hit_node, nodes_to_load, mem_quota, delta)
        finally:
            for loaded in nodes_to_load:
                loaded.release_host()
        if device_indices is None:
            self.dec_lock_ref(cached_ancestor)
            return None

        self.ongoing_load_back[hit_node.id] = hit_node
        offset = 0
        for loaded in nodes_to_load:
            loaded.value = device_indices[offset : offset + len(loaded.host_value)].clone()
            self._on_device_value(loaded, offset)
            offset += len(loaded.host_value)
            self._record_store_event(loaded, medium=GPU)
        self.evictable_size_ += len(device_indices)
        self._lock_path(hit_node, cached_ancestor)

        if self.metrics_collector is not None:
            self.metrics_collector.observe_load_back_duration(time.perf_counter() - start_time)
            self.metrics_collector.increment_load_back_num_tokens(len(device_indices))
        return device_indices

    def _load_nodes(
        self, hit_node: TreeNode, nodes_to_load: List[TreeNode], mem_quota: Optional[int], delta: int
    ) -> Optional[torch.Tensor]:
        """Upstream's admission (threshold, quota), then the H2D copy of ``nodes_to_load``
        (protected); the new device locs, or None when the load is skipped."""
        num_tokens = sum(len(node.key) for node in nodes_to_load)  # == their host values
        if mem_quota is None:
            mem_quota = self._default_load_quota()
        too_short = num_tokens < self.load_back_threshold
        # delta <= 0: the ancestors just locked are no longer evictable.
        over_quota = mem_quota is not None and num_tokens > mem_quota + delta
        if too_short or over_quota:
            return None
        return self._load_host_values(hit_node, nodes_to_load)

    def _default_load_quota(self) -> Optional[int]:
        """The quota when the scheduler passes none: upstream checks none."""
        return None

    def _load_host_values(self, hit_node: TreeNode, nodes_to_load: List[TreeNode]) -> Optional[torch.Tensor]:
        """Upstream's load of the host values of ``nodes_to_load`` (in order): copy, and on
        a full device evict and copy once more."""
        if len(nodes_to_load) == 1:  # the usual case; load() only reads host_indices
            host_indices = nodes_to_load[0].host_value
        else:
            host_indices = torch.cat([n.host_value for n in nodes_to_load])
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
            logger.warning(
                "load_back: FAILED to load %d tokens for node %d even after eviction "
                "(evictable_size=%d)",
                len(host_indices),
                hit_node.id,
                self.evictable_size_,
            )
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
