"""Builds what one scheduler rank builds for an NSA model with HiCache, on the CPU runtime.

Real SGLang classes throughout: ``NSATokenToKVPool`` (physical, per rank), the allocator
(logical owner-lane allocator in CP mode, upstream ``PagedTokenToKVPoolAllocator`` for the
non-CP baseline), ``ReqToTokenPool``, host pools and the HiRadixCache with its controller.
Also provides a deterministic KV pattern: "prefill" writes values that are a function of
(token id, position, layer) into this rank's owned physical slots, so any rank can check
what a cache hit returns. With ``StackConfig.draft`` the stack also has the MTP draft's
one-layer NSA pool (the target's physical size, as under shared KV), handed to the CP cache
as SGLang's scheduler hook does; its pattern uses a layer id no target layer has, so a
target byte in a draft slot (or the reverse) is a mismatch.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
INDEX_HEAD_DIM = 128
INDEX_BYTES_PER_TOKEN = INDEX_HEAD_DIM + 4  # fp8 K + fp32 scale, per NSATokenToKVPool
DRAFT_LAYERS = 1  # the NSA MTP draft (NextN)
DRAFT_PATTERN_LAYER = 96  # the draft layer's pattern id: no target layer's (mod 97 / 256)


@dataclass(frozen=True)
class StackConfig:
    cp_size: int = 2
    layer_num: int = 2
    physical_tokens: int = 64 * 32  # per-rank device pool
    page_size: int = 64
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    io_backend: str = "direct"
    mem_layout: str = "layer_first"
    req_pool_size: int = 64
    max_context_len: int = 8192
    write_policy: str = "write_through"
    draft: bool = False  # the MTP draft's 1-layer pool beside the target (CP stacks)
    device: str = "cpu"  # "cuda" on a GPU (the offline device check), with the real kernels


@dataclass
class RankStack:
    """One rank's cache stack."""

    cache: Any
    allocator: Any
    kv_pool: Any
    req_to_token_pool: Any
    layout: Any  # CpSharedKVLayout, or None for the upstream baseline
    draft_pool: Any = None  # the MTP draft's NSA pool (StackConfig.draft)

    def close(self) -> None:
        atexit.unregister(self.cache.shutdown)


def _server_args(cfg: StackConfig):
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        page_size=cfg.page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=cfg.hicache_ratio,
        hicache_size=cfg.hicache_size,
        hicache_write_policy=cfg.write_policy,
        hicache_io_backend=cfg.io_backend,
        hicache_mem_layout=cfg.mem_layout,
    )
    # model_path="dummy" returns from __post_init__ early; apply the real normalisation.
    server_args._handle_hicache()
    return server_args


def build_kv_pool(cfg: StackConfig, layer_num: Optional[int] = None):
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    return NSATokenToKVPool(
        cfg.physical_tokens,
        page_size=cfg.page_size,
        kv_lora_rank=KV_LORA_RANK,
        dtype=torch.bfloat16,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        layer_num=cfg.layer_num if layer_num is None else layer_num,
        device=cfg.device,
        index_head_dim=INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=KV_LORA_RANK + QK_ROPE_HEAD_DIM,
    )


def build_rank_stack(
    cfg: StackConfig,
    cp_rank: int,
    cp_group: Any,
    attn_tp_group: Any,
    shared_kv: bool = True,
    cache_cls: Optional[type] = None,
) -> RankStack:
    """One scheduler rank's stack; ``shared_kv=False`` builds upstream non-CP HiCache.

    ``cache_cls`` overrides the HiRadixCache class (e.g. whatever SGLang's module exports
    after plugins load, as the scheduler would construct it). ``cfg.draft`` (shared KV only)
    adds the MTP draft's pool, handed to the cache as the scheduler hook does, and marks
    the server speculative (NEXTN).
    """
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
    from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import UPSTREAM
    from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache, draft_kv_pool_scope

    if cfg.draft and not shared_kv:
        raise ValueError("StackConfig.draft needs the shared-KV (CP) stack")
    kv_pool = build_kv_pool(cfg)
    draft_pool = build_kv_pool(cfg, layer_num=DRAFT_LAYERS) if cfg.draft else None
    common = dict(page_size=cfg.page_size, dtype=torch.bfloat16, device=cfg.device, kvcache=kv_pool)
    if shared_kv:
        allocator = CPSharedPagedTokenToKVPoolAllocator(
            cfg.physical_tokens,
            need_sort=False,
            cp_size=cfg.cp_size,
            cp_rank=cp_rank,
            **common,
        )
        default_cls, layout = CpHiRadixCache, allocator.layout
    else:
        allocator = PagedTokenToKVPoolAllocator(cfg.physical_tokens, need_sort=False, **common)
        default_cls, layout = UPSTREAM["HiRadixCache"], None
    req_to_token_pool = ReqToTokenPool(
        cfg.req_pool_size, cfg.max_context_len, device=cfg.device, enable_memory_saver=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        tp_cache_group=attn_tp_group,
        attn_cp_cache_group=cp_group if shared_kv else None,
        attn_tp_cache_group=attn_tp_group,
        eviction_policy="lru",
    )
    server_args = _server_args(cfg)
    if cfg.draft:
        server_args.speculative_algorithm = "NEXTN"
    with draft_kv_pool_scope(draft_pool):
        cache = (cache_cls or default_cls)(params=params, server_args=server_args)
    return RankStack(cache, allocator, kv_pool, req_to_token_pool, layout, draft_pool)


def unit_stack(attn_tp_group: Any, shared_kv: bool = True, cp_rank: int = 0, **overrides: Any) -> RankStack:
    """The unit tests' one-process rank: 16 pages per rank at cp 2 unless ``overrides``
    say otherwise, the plugin's ``CpHiRadixCache`` with CP on and off (flag off: the class
    the plugin puts in place of upstream's)."""
    from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache

    page_size = overrides.get("page_size", StackConfig.page_size)
    cfg = StackConfig(**{"physical_tokens": 16 * page_size, **overrides})
    return build_rank_stack(
        cfg, cp_rank, None, attn_tp_group, shared_kv=shared_kv, cache_cls=CpHiRadixCache
    )


# --------------------------------------------------------------------- KV pattern
def expected_kv_rows(token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """MLA latent rows [n, 1, 576] (bf16-exact small integers) for the given tokens, on
    their device."""
    dim = KV_LORA_RANK + QK_ROPE_HEAD_DIM
    base = (token_ids.to(torch.int64) * 31 + positions.to(torch.int64) * 17 + layer * 7) % 97
    values = (base.unsqueeze(1) + torch.arange(dim, device=base.device)) % 251 - 125
    return values.to(torch.bfloat16).unsqueeze(1)


def expected_index_bytes(token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """Indexer K (128 B) + scale (4 B) per token, uint8 [n, 132], on their device."""
    base = (token_ids.to(torch.int64) * 13 + positions.to(torch.int64) * 7 + layer * 3) % 256
    columns = torch.arange(INDEX_BYTES_PER_TOKEN, device=base.device)
    return ((base.unsqueeze(1) + columns) % 256).to(torch.uint8)


def _index_byte_offsets(physical_locs: torch.Tensor, page_size: int) -> tuple:
    """(page, [132 byte offsets]) of each token in NSA's paged index-K buffer."""
    pages = physical_locs // page_size
    offsets = physical_locs % page_size
    device = physical_locs.device
    k_cols = offsets.unsqueeze(1) * INDEX_HEAD_DIM + torch.arange(INDEX_HEAD_DIM, device=device)
    scale_cols = page_size * INDEX_HEAD_DIM + offsets.unsqueeze(1) * 4 + torch.arange(4, device=device)
    return pages, torch.cat([k_cols, scale_cols], dim=1)


def owned_physical(stack: RankStack, logical_locs: torch.Tensor):
    """(positions into ``logical_locs`` this rank stores, their physical locs), both on the
    locs' device."""
    if stack.layout is None:
        return torch.arange(len(logical_locs)), logical_locs.to(torch.int64)
    positions = stack.layout.owned_positions(logical_locs.to(torch.int64))
    return positions, stack.layout.logical_locs_to_physical(logical_locs[positions].to(torch.int64))


def _pattern_layers(stack: RankStack, draft: bool) -> list:
    """(pool layer, pattern layer id) of the target pool, or of the draft pool."""
    if draft:
        return [(layer, DRAFT_PATTERN_LAYER + layer) for layer in range(stack.draft_pool.layer_num)]
    return [(layer, layer) for layer in range(stack.kv_pool.layer_num)]


def write_prefill_kv(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """What a forward pass stores: owned tokens only, MLA KV and indexer K/scale; with a
    draft, also what the draft's prefill extend stores (its own pattern)."""
    write_pool_kv(stack, logical_locs, token_ids, positions)
    if stack.draft_pool is not None:
        write_pool_kv(stack, logical_locs, token_ids, positions, draft=True)


def write_pool_kv(
    stack: RankStack,
    logical_locs: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    draft: bool = False,
) -> None:
    """The target forward's stores (or, ``draft``, the draft forward's) of owned tokens."""
    stores = prepare_stores(stack, logical_locs, token_ids, positions, draft)
    if stores is not None:
        for layer in range(stores.pool.layer_num):
            stores.store(layer)


@dataclass
class PreparedStores:
    """One node's owned stores into one pool, computed ahead on the pool's device, so a
    forward can issue one layer's stores with device work only (no host sync between the
    layer's compute and its stores)."""

    pool: Any
    physical_locs: torch.Tensor
    index_pages: torch.Tensor  # [n, 1]
    index_cols: torch.Tensor  # [n, 132]
    kv_rows: List[torch.Tensor]  # per pool layer
    index_bytes: List[torch.Tensor]  # per pool layer

    def store(self, layer: int) -> None:
        """Layer ``layer``'s MLA KV and indexer K/scale of the owned tokens."""
        self.pool.kv_buffer[layer][self.physical_locs] = self.kv_rows[layer]
        self.pool.index_k_with_scale_buffer[layer][self.index_pages, self.index_cols] = self.index_bytes[layer]


def prepare_stores(
    stack: RankStack,
    logical_locs: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    draft: bool = False,
) -> Optional[PreparedStores]:
    """The pattern stores of this rank's owned tokens of ``logical_locs`` into the target
    pool (or the draft's); None when this rank owns none of them."""
    owned, physical_locs = owned_physical(stack, logical_locs)
    if len(owned) == 0:
        return None
    ids, pos = token_ids.to(owned.device)[owned], positions.to(owned.device)[owned]
    pool = stack.draft_pool if draft else stack.kv_pool
    pages, cols = _index_byte_offsets(physical_locs, pool.page_size)
    patterns = [pattern for _, pattern in _pattern_layers(stack, draft)]
    return PreparedStores(
        pool, physical_locs, pages.unsqueeze(1), cols,
        [expected_kv_rows(ids, pos, pattern) for pattern in patterns],
        [expected_index_bytes(ids, pos, pattern) for pattern in patterns],
    )  # fmt: skip


def count_kv_mismatches(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> int:
    """Owned tokens whose target KV or indexer bytes differ from the pattern (this rank)."""
    bad = _mismatch_masks(stack, logical_locs, token_ids, positions)
    return int(torch.stack(bad).any(dim=0).sum()) if bad else 0


def count_draft_kv_mismatches(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> int:
    """Owned tokens whose draft KV or indexer bytes differ from the draft's pattern."""
    bad = _mismatch_masks(stack, logical_locs, token_ids, positions, draft=True)
    return int(torch.stack(bad).any(dim=0).sum()) if bad else 0


def kv_mismatches_per_layer(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> list:
    """Per target layer (then, with a draft, per draft layer), the owned tokens whose KV
    or indexer bytes differ from the pattern."""
    layers = stack.kv_pool.layer_num + (stack.draft_pool.layer_num if stack.draft_pool is not None else 0)
    bad = _mismatch_masks(stack, logical_locs, token_ids, positions)
    if stack.draft_pool is not None:
        bad += _mismatch_masks(stack, logical_locs, token_ids, positions, draft=True)
    return [int(mask.sum()) for mask in bad] or [0] * layers


def _mismatch_masks(stack, logical_locs, token_ids, positions, draft: bool = False) -> list:
    """Per layer of the target (or draft) pool, a mask over this rank's owned tokens of
    those with wrong bytes."""
    owned, physical_locs = owned_physical(stack, logical_locs)
    if len(owned) == 0:
        return []
    ids, pos = token_ids.to(owned.device)[owned], positions.to(owned.device)[owned]
    pool = stack.draft_pool if draft else stack.kv_pool
    pages, cols = _index_byte_offsets(physical_locs, pool.page_size)
    masks = []
    for layer, pattern in _pattern_layers(stack, draft):
        kv = pool.kv_buffer[layer][physical_locs]
        bad = (kv != expected_kv_rows(ids, pos, pattern)).reshape(len(owned), -1).any(dim=1)
        index_bytes = pool.index_k_with_scale_buffer[layer][pages.unsqueeze(1), cols]
        bad |= (index_bytes != expected_index_bytes(ids, pos, pattern)).any(dim=1)
        masks.append(bad)
    return masks


def wipe_device_kv(stack: RankStack) -> None:
    """Zero the whole device pool (and the draft's), so only a real load-back can restore
    bytes."""
    for pool in (stack.kv_pool, stack.draft_pool):
        if pool is None:
            continue
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer].zero_()
            pool.index_k_with_scale_buffer[layer].zero_()


def radix_key(token_ids: list):
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(list(token_ids))


def insert_at_root(stack: RankStack, token_ids: list, locs: Optional[torch.Tensor] = None):
    """Insert ``token_ids`` as a new child of the root (fresh slots unless ``locs``) without
    checking HiCache events, so a write-through backup's ack stays queued; return the node."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    key = radix_key(token_ids)
    locs = stack.allocator.alloc(len(token_ids)) if locs is None else locs
    stack.cache.insert(InsertParams(key=key, value=locs))
    return stack.cache.root_node.children[key.child_key(stack.cache.page_size)]


# ------------------------------------------------------------------ node runs
def device_run_mismatches(cache: Any) -> List[str]:
    """Every device node's host locs (``cp_device_locs``) and, where derived,
    ``cp_device_run`` / ``cp_device_lanes`` (what the CP planners read) against its value
    read back from the device: one line per node that differs or has no host locs.
    Reading ``node.value`` here is the check's own cost."""
    import numpy as np

    from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64

    problems = []
    nodes = list(cache.root_node.children.values())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        if node.value is None:
            continue
        host_locs = getattr(node, "cp_device_locs", None)
        if host_locs is None:
            problems.append(f"node {node.id}: device value without host locs")
            continue
        locs = host_int64(node.value)
        if not np.array_equal(host_locs, locs):
            problems.append(
                f"node {node.id}: host locs {host_locs[:4].tolist()}.. != device value "
                f"{locs[:4].tolist()}.."
            )
        run = getattr(node, "cp_device_run", None)
        if run is None:
            continue
        lanes = np.bincount(
            cache.layout.owner_for_logical_pages(locs[:: cache.page_size] // cache.page_size),
            minlength=cache.layout.cp_size,
        ).tolist()
        if not np.array_equal(run.locs, locs) or node.cp_device_lanes != lanes:
            problems.append(
                f"node {node.id}: host run {run.locs[:4].tolist()}.. (lanes "
                f"{node.cp_device_lanes}) != device value {locs[:4].tolist()}.. (lanes {lanes})"
            )
    return problems
