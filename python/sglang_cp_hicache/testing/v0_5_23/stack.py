"""One rank's REAL SGLang 0.5.23 DSA HiCache stack, built on CPU.

What a scheduler rank of a PD-prefill worker with ``--enable-kv-cache-sharding`` holds, built
directly (as upstream's own kit does, ``sglang/test/kits/unified_radix_cache/fixtures.py``)
instead of through ``KVCacheConfigurator``:

* sharded (``shard_size > 1``, one :func:`~sglang_cp_hicache.testing.dist.run_ranks` rank
  each): ``PageInterleaveDSATokenToKVPool`` over a gloo shard group,
  ``PageInterleavePoolAllocator`` (the logical index space, ``shard_size`` x one rank's
  rows), and after ``init_hicache`` a ``HybridCacheController`` whose KV host pool is a
  ``PageInterleaveHostPool``;
* unsharded (the replicated reference): ``DSATokenToKVPool``,
  ``PagedTokenToKVPoolAllocator`` and plain host pools.

``StackConfig.mtp_draft`` adds the EAGLE MTP draft's device pool (one NextN layer) as a
PD prefill worker builds it: sharded, a ``PageInterleaveDSATokenToKVPool`` with the target's
shard spec and group and its own buffers (``_build_mtp_kv_shard_pool``,
``kv_cache_configurator.py:1922``); unsharded, a one-layer ``DSATokenToKVPool``. It is
handed to ``init_hicache`` as ``CacheInitParams.mtp_draft_device_pools`` (what
``_build_hicache_draft_plan``'s PACKED mode sets), so upstream packs the draft's latent KV
and indexer as the tail host layer of the target's host pools, in the same host slots.

Both share ``ReqToTokenPool`` and ``UnifiedRadixCache`` with the Python tree core (the only
core sharding accepts). The radix tree, allocator and ``req_to_token`` are logical and
identical on every rank; the device and host pools are physical, per rank. Call
:func:`~sglang_cp_hicache.testing.install` before SGLang is imported (``run_ranks`` ranks
and the root ``conftest.py`` do).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.dist import RankContext
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

logger = logging.getLogger(__name__)

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


def publish_server_args(
    config: StackConfig, sharded: bool, storage_backend: Optional[str] = None
) -> Any:
    """The process's ServerArgs, published the way the cache reads its config (publishing
    resolves it). ``storage_backend``: HiCache with that L3 backend; with
    ``config.cp_shared_kv`` on an unsharded stack it is the flag's one-prefill-rank mode
    (a ``--tp 1`` server with the owner-free L3 keys), the only unsharded use of the flag."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    flag_fields = (
        dict(enable_prefill_cp=True, cp_strategy="interleave", disaggregation_mode="prefill")
        if config.cp_shared_kv
        else {}
    )
    if storage_backend is not None:
        flag_fields.update(enable_hierarchical_cache=True, hicache_storage_backend=storage_backend)
    server_args = ServerArgs(
        model_path="dummy",
        page_size=config.page_size,
        context_length=config.context_len,
        chunked_prefill_size=config.chunk_tokens,
        hicache_ratio=config.host_to_device_ratio,
        hicache_io_backend=config.io_backend,
        hicache_mem_layout=config.mem_layout,
        hicache_write_policy=config.write_policy,
        hicache_host_memory_mode="cache",
        enable_kv_cache_sharding=sharded,
        **flag_fields,
    )
    if config.cp_shared_kv:
        if not sharded and storage_backend is None:
            raise ValueError(
                "StackConfig.cp_shared_kv needs a sharded stack (unsharded: only with an L3 "
                "backend, the flag on one prefill rank)"
            )
        from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

        set_cp_shared_kv_enabled(server_args, True)  # publishing resolves the record
    set_global_server_args_for_scheduler(server_args)
    return server_args


def _dsa_pool_kwargs(config: StackConfig, layer_num: Optional[int] = None) -> dict:
    """A DSA device pool's geometry: the target's, or ``layer_num`` layers (the draft)."""
    kwargs = dict(
        page_size=config.page_size,
        kv_lora_rank=config.kv_lora_rank,
        dtype=config.dtype,
        qk_rope_head_dim=config.qk_rope_head_dim,
        layer_num=config.layer_num if layer_num is None else layer_num,
        device=config.device,
        index_head_dim=config.index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=config.kv_cache_dim,
    )
    if layer_num is None and config.skip_topk_layers is not None:  # the draft's one layer has its own
        kwargs["skip_topk_layers"] = list(config.skip_topk_layers)
    return kwargs


def _build_cache(
    config: StackConfig,
    server_args: Any,
    allocator: Any,
    req_to_token_pool: Any,
    groups: dict,
    draft_kv_pool: Any = None,
) -> tuple[Any, Any]:
    """UnifiedRadixCache (Python core, FULL component) with HiCache initialised; a draft
    pool is packed into the host pools as upstream's PACKED draft plan does."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=config.page_size,
        tree_components=(ComponentType.FULL,),
        mtp_draft_device_pools=() if draft_kv_pool is None else (draft_kv_pool,),
        **groups,
    )
    # Sharding forces the Python core (kv_shard_hook.py:132-144); so does the reference.
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):
        cache = UnifiedRadixCache(params=params)
    cache.init_hicache(server_args, params)
    return cache, params


def _req_to_token_pool(config: StackConfig) -> Any:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(
        size=config.max_num_reqs, max_context_len=config.context_len, device=config.device,
        enable_memory_saver=False,
    )  # fmt: skip


def build_sharded_stack(ctx: RankContext, config: StackConfig = StackConfig()) -> RankStack:
    """Rank ``ctx.rank``'s sharded stack; every rank of ``ctx.cp_group`` must call it.

    The shard group is the CP group (upstream's ``get_kv_shard_group`` under prefill CP);
    the pool's gather communicator is gloo (the runtime rebinds ``PyNcclCommunicator``).
    """
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    shard_group = GlooShardGroup.from_rank_context(ctx)
    shard_group = dataclasses.replace(shard_group, device=torch.device(config.device))
    if shard_group.world_size < 2:
        raise ValueError("build_sharded_stack needs a shard group of at least 2 ranks")
    server_args = publish_server_args(config, sharded=True)
    spec = PageShardSpec(
        shard_rank=shard_group.rank_in_group,
        shard_size=shard_group.world_size,
        page_size=config.page_size,
        max_prefix_tokens=config.scratch_prefix_tokens(shard_group.world_size),
        chunk_tokens=config.chunk_tokens,
    )
    kv_pool = PageInterleaveDSATokenToKVPool(
        config.device_rows_per_rank,
        shard_spec=spec,
        shard_group=shard_group,
        **_dsa_pool_kwargs(config),
    )
    draft_kv_pool = None
    if config.mtp_draft:  # upstream's _build_mtp_kv_shard_pool: the target's spec and group
        draft_kv_pool = PageInterleaveDSATokenToKVPool(
            kv_pool.size,
            shard_spec=kv_pool.shard_spec,
            shard_group=kv_pool.shard_group,
            index_kpool=1,
            **_dsa_pool_kwargs(config, layer_num=config.draft_layer_num),
        )
    allocator = PageInterleavePoolAllocator(
        config.device_rows_per_rank,
        physical_page_size=config.page_size,
        shard_size=spec.shard_size,
        dtype=config.dtype,
        device=config.device,
        kvcache=kv_pool,
        need_sort=True,  # PD prefill workers sort (kv_cache_configurator need_sort)
        shard_spec=spec,
    )
    req_to_token_pool = _req_to_token_pool(config)
    groups = dict(
        tp_cache_group=ctx.attn_tp_group,
        attn_cp_cache_group=ctx.cp_group,
        attn_tp_cache_group=ctx.attn_tp_group,
        attn_cp_rank=spec.shard_rank,
        attn_cp_size=spec.shard_size,
    )
    cache, params = _build_cache(
        config, server_args, allocator, req_to_token_pool, groups, draft_kv_pool
    )
    return RankStack(
        config=config,
        shard_rank=spec.shard_rank,
        shard_size=spec.shard_size,
        server_args=server_args,
        kv_pool=kv_pool,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        cache=cache,
        params=params,
        shard_group=shard_group,
        placement=PageInterleavePlacement(spec),
        draft_kv_pool=draft_kv_pool,
    )


_hooks_applied: List[bool] = []  # once per process: a second apply would wrap the targets again


def apply_plugin_hooks() -> None:
    """Register the 0.5.23 line's hooks and apply them in this process (a rank), once;
    raises naming any hook not in place."""
    if _hooks_applied:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_23.hooks import missing_hooks

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not in place: {missing}")
    _hooks_applied.append(True)


@contextlib.contextmanager
def sharded_stack(
    ctx: RankContext, config: StackConfig = StackConfig(), *, plugin_hooks: bool = True
) -> Iterator[RankStack]:
    """A multi-rank test's stack: the plugin's hooks applied in this rank (unless
    ``plugin_hooks`` is False: upstream alone), then :func:`build_sharded_stack`. On exit,
    also on error, it closes what it opened: the stack (host pools, the cache's atexit
    hook) and the runtime context it published (server args), restored as found."""
    from sglang.srt.runtime_context import restore_context, snapshot_context

    if plugin_hooks:
        apply_plugin_hooks()
    before = snapshot_context()
    try:
        with build_sharded_stack(ctx, config) as stack:
            yield stack
    finally:
        restore_context(before)


def build_unsharded_stack(tp_group: Any, config: StackConfig = StackConfig()) -> RankStack:
    """The replicated reference: one rank holding every page (``tp_group``: its cache's
    TP group, e.g. :func:`~sglang_cp_hicache.testing.dist.single_rank_world`)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    server_args = publish_server_args(config, sharded=False)
    kv_pool = DSATokenToKVPool(config.device_rows_per_rank, **_dsa_pool_kwargs(config))
    draft_kv_pool = None
    if config.mtp_draft:
        draft_kv_pool = DSATokenToKVPool(
            config.device_rows_per_rank, **_dsa_pool_kwargs(config, config.draft_layer_num)
        )
    allocator = PagedTokenToKVPoolAllocator(
        config.device_rows_per_rank,
        page_size=config.page_size,
        dtype=config.dtype,
        device=config.device,
        kvcache=kv_pool,
        need_sort=True,
    )
    req_to_token_pool = _req_to_token_pool(config)
    cache, params = _build_cache(
        config, server_args, allocator, req_to_token_pool, dict(tp_cache_group=tp_group),
        draft_kv_pool,
    )
    return RankStack(
        config=config,
        shard_rank=0,
        shard_size=1,
        server_args=server_args,
        kv_pool=kv_pool,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        cache=cache,
        params=params,
        draft_kv_pool=draft_kv_pool,
    )


__all__ = [
    "MTP_DRAFT_LAYERS",
    "RankStack",
    "SCRATCH_PREFIX_CONTEXTS",
    "StackConfig",
    "TreeNodeView",
    "apply_plugin_hooks",
    "build_sharded_stack",
    "build_unsharded_stack",
    "sharded_stack",
]
