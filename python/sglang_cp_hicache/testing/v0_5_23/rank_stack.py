"""One rank's SGLang 0.5.23 DSA HiCache stack as a test holds it: its geometry and HiCache
options (:class:`StackConfig`), the pieces built (:class:`RankStack`: logical allocator and
tree, physical pools, the placement between them) and a node as every rank must see it
(:class:`TreeNodeView`). Building one is :mod:`~sglang_cp_hicache.testing.v0_5_23.stack`'s job."""

from __future__ import annotations

import atexit
from array import array
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup


#: Upstream sizes the scratch prefix region for eight full contexts
#: (``page_interleave._KV_SHARD_SCRATCH_PREFIX_CONTEXTS``); the default here follows it.
SCRATCH_PREFIX_CONTEXTS = 8

#: Upstream shards only a one-NextN-layer EAGLE draft (``kv_shard_hook.py:105-118``).
MTP_DRAFT_LAYERS = 1


@dataclass(frozen=True)
class StackConfig:
    """Geometry and HiCache options of one stack (small defaults: a few MiB per rank).

    ``device_pages_per_rank`` counts one rank's allocatable physical pages; each rank's
    pool has one more (page 0, upstream's reserved trash page). The logical device
    capacity is ``shard_size * device_pages_per_rank`` pages.
    """

    page_size: int = 64  # DSA's indexer kernels need 64
    layer_num: int = 2
    device_pages_per_rank: int = 16
    host_to_device_ratio: float = 2.0
    io_backend: str = "kernel"
    mem_layout: str = "layer_first"
    write_policy: str = "write_through"
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    context_len: int = 1024
    chunk_tokens: int = 1024
    max_num_reqs: int = 8
    max_prefix_tokens: Optional[int] = None  # scratch prefix rows; None: 8 contexts
    # The plugin's flag on the stack's record (sharded stacks only): marked before the
    # record is resolved, with what the flag requires of it (prefill CP interleave on a
    # PD prefill worker), as a launch with --enable-nsa-prefill-cp-shared-kv builds it.
    cp_shared_kv: bool = False
    # The EAGLE MTP draft (one NextN layer, upstream's only sharded draft) packed in the
    # target's host slots; its device pool is RankStack.draft_kv_pool.
    mtp_draft: bool = False
    # Where the device pools, allocator and req_to_token live: "cpu" (the CPU runtime) or
    # "cuda" (the GPU check's round trip, scripts/gpu/device_check.py --sglang 0.5.23).
    device: str = "cpu"
    # Per target layer: True where the layer reuses another layer's top-k and so holds no
    # DSA indexer buffer (upstream's ``skip_topk_layers``: a 0-row placeholder on the
    # device, no host layer); None: every layer has an indexer.
    skip_topk_layers: Optional[Tuple[bool, ...]] = None
    # The cache's Prometheus collector (``--enable-metrics``): upstream's radix-cache
    # metrics and, with the plugin's flag, the plugin's own (one stack per process: the
    # collectors register in the process's default registry).
    enable_metrics: bool = False
    # The cache's KV event recorder on, as a scheduler with --kv-events-config builds it:
    # on the publisher rank only (shard rank 0; every rank of an unsharded stack).
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.chunk_tokens % self.page_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} is not page-aligned")

    @property
    def device_rows_per_rank(self) -> int:
        """Allocatable physical token rows of one rank (the pool's ``size``)."""
        return self.device_pages_per_rank * self.page_size

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def draft_layer_num(self) -> int:
        """Device layers of the MTP draft (host tail layers ``layer_num + i``)."""
        return MTP_DRAFT_LAYERS if self.mtp_draft else 0

    def scratch_prefix_tokens(self, shard_size: int) -> int:
        """The scratch prefix region: given, or eight contexts each rounded up to a
        gather span (``shard_size`` pages), as ``make_page_shard_spec`` sizes it."""
        if self.max_prefix_tokens is not None:
            return self.max_prefix_tokens
        span = shard_size * self.page_size
        return SCRATCH_PREFIX_CONTEXTS * (-(-self.context_len // span) * span)


@dataclass(frozen=True)
class TreeNodeView:
    """One radix node as every rank must see it: logical keys, locs and flags only."""

    node_id: int
    parent_id: int
    token_ids: Tuple[int, ...]
    logical_device_locs: Optional[Tuple[int, ...]]  # None: evicted from device
    logical_host_locs: Optional[Tuple[int, ...]]  # None: not backed up
    host_backed: bool
    rotation_base: Optional[int]


@dataclass
class RankStack:
    """The pieces of one rank's stack. ``shard_group``/``placement`` are None unsharded.

    Invariants: ``allocator.get_kvcache() is kv_pool``; ``cache.cache_controller`` is the
    HybridCacheController built by ``init_hicache``; logical locs come from ``allocator``
    and index ``kv_pool`` (and ``draft_kv_pool``, which shares the allocator and the
    placement) only through ``placement`` (sharded) or directly (unsharded).
    """

    config: StackConfig
    shard_rank: int
    shard_size: int
    server_args: Any
    kv_pool: Any  # DSATokenToKVPool or PageInterleaveDSATokenToKVPool (physical rows)
    allocator: Any  # PagedTokenToKVPoolAllocator or PageInterleavePoolAllocator (logical)
    req_to_token_pool: Any
    cache: Any  # UnifiedRadixCache
    params: Any  # CacheInitParams
    shard_group: Optional[GlooShardGroup] = None
    placement: Any = None  # PageInterleavePlacement
    draft_kv_pool: Any = None  # the MTP draft's device pool (StackConfig.mtp_draft)
    _closed: bool = field(default=False, repr=False)

    @property
    def sharded(self) -> bool:
        return self.shard_size > 1

    @property
    def controller(self) -> Any:
        return self.cache.cache_controller

    @property
    def host_pool_group(self) -> Any:
        """The controller's ``HostPoolGroup`` (KV anchor + DSA indexer)."""
        return self.controller.mem_pool_host

    @property
    def kv_host_pool(self) -> Any:
        """The KV anchor host pool (a ``PageInterleaveHostPool`` when sharded)."""
        return self.host_pool_group.anchor_entry.host_pool

    @property
    def indexer_host_pool(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.host_pool_group.entry_map[PoolName.INDEXER].host_pool

    def device_available(self) -> int:
        """Logical device slots the allocator admits (sharded: the min-class floor)."""
        return self.allocator.available_size()

    def host_available(self) -> int:
        """Logical host slots the KV host pool can still allocate."""
        return self.kv_host_pool.available_size()

    def physical_rows(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """This rank's physical rows of the logical slots it owns, in order."""
        if not self.sharded:
            return logical_locs
        return self.placement.filter_local(logical_locs, self.shard_rank)

    def owned_mask(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Which logical slots this rank stores (all of them unsharded)."""
        if not self.sharded:
            return torch.ones_like(logical_locs, dtype=torch.bool)
        return self.placement.local_mask(logical_locs, self.shard_rank)

    def owned_pages(self, logical_locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Of one request's ``logical_locs`` (token order, page-aligned): the positions,
        among its pages, of those this rank owns, and their physical pages."""
        page = self.config.page_size
        first = logical_locs[::page]
        return torch.nonzero(self.owned_mask(first)).squeeze(1), self.physical_rows(first) // page

    def alloc_extend(
        self, prefix_locs: torch.Tensor, seq_len: int, rotation_base: Optional[int] = None
    ) -> Tuple[torch.Tensor, Optional[int]]:
        """Fresh logical locs for positions ``[len(prefix_locs), seq_len)`` of one request,
        and the chain's rotation base (sharded: ``None`` starts a new chain at the
        least-full owner class, as upstream does; unsharded: always ``None``).

        Raises ``RuntimeError`` when the allocator cannot supply the pages.
        """
        prefix_len = len(prefix_locs)
        prefix = torch.tensor([prefix_len], dtype=torch.int64)
        seq = torch.tensor([seq_len], dtype=torch.int64)
        last = prefix_locs[-1:].to(torch.int64) if prefix_len else torch.tensor([-1])
        device = self.config.device  # the allocator's kernel reads the device copies
        args = (prefix.to(device), prefix, seq.to(device), seq, last.to(device), seq_len - prefix_len)
        if self.sharded:
            bases = [rotation_base]
            locs = self.allocator.alloc_extend(*args, rotation_bases=bases)
            rotation_base = bases[0]
        else:
            locs = self.allocator.alloc_extend(*args)
        if locs is None:
            raise RuntimeError(
                f"rank {self.shard_rank}: no device pages for {seq_len - prefix_len} tokens"
            )
        return locs, rotation_base

    def insert(
        self,
        token_ids: Sequence[int],
        logical_locs: torch.Tensor,
        rotation_base: Optional[int],
        cached_len: int = 0,
    ) -> Any:
        """Insert one request's tokens with their logical locs (``InsertResult``).

        ``cached_len``: leading tokens whose locs the request took from the tree (its
        matched prefix, ``req.kv.cache_protected_len``). The insert frees the request's
        own duplicates of cached KV past it, so passing 0 for a matched prefix frees
        the tree's pages (a double free later).
        """
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(array("q", token_ids))
        return self.cache.insert(
            InsertParams(
                key=key,
                value=logical_locs,
                prev_prefix_len=cached_len,
                rotation_base=rotation_base,
            )
        )

    def match(self, token_ids: Sequence[int]) -> Any:
        """``match_prefix`` of ``token_ids`` (a ``MatchResult``)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", token_ids))))

    def tree_snapshot(self) -> Tuple[TreeNodeView, ...]:
        """Every node of the radix tree but the root, by node id: what must be identical
        on every rank of a shard group (the tree is logical)."""
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        def as_list(value: Any) -> Optional[Tuple[int, ...]]:
            return None if value is None else tuple(int(v) for v in value)

        root = self.cache.tree_core.root_node
        views, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            full = node.component_data[ComponentType.FULL]
            views.append(
                TreeNodeView(
                    node_id=node.id,
                    parent_id=node.parent.id,
                    token_ids=tuple(node.key.raw_token_ids()),
                    logical_device_locs=as_list(full.value),
                    logical_host_locs=as_list(full.host_value),
                    host_backed=node.backuped,
                    rotation_base=node.rotation_base,
                )
            )
        return tuple(sorted(views, key=lambda view: view.node_id))

    def close(self) -> None:
        """Release the host pools and drop the cache's atexit hook (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.cache.shutdown)
        self.cache.release_host_resources()

    def __enter__(self) -> "RankStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MTP_DRAFT_LAYERS", "RankStack", "SCRATCH_PREFIX_CONTEXTS", "StackConfig", "TreeNodeView"]
