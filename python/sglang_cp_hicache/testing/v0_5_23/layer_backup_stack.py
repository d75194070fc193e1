"""A prefill forward's KV stores on the REAL 0.5.23 sharded stack, for per-layer backup.

:func:`store_layer` is what one layer of a forward stores over a batch (the DSA indexer's
index K pages, then the MLA latent of the whole batch in one call of the sharded pool's own
``set_mla_kv_buffer``, after which the plugin's store hook reports the layer);
:func:`forward` runs every layer and reports the forward's end. :func:`time_backups` is the
rank side of ``benchmark/bench_per_layer_backup.py``'s 0.5.23 mode: upstream's all-layer
path (flag off) and the plugin's per-layer path (flag on) over the same trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.dist import RankContext

#: One request of a forward batch: its logical locs and its logical KV, (latent
#: [layer, token, 1, dim], indexer [layer, page, bytes]) identical on every rank.
BatchItem = Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def apply_plugin_hooks() -> None:
    """The plugin's hooks applied in this process (every one of them in place)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_23.hooks import missing_hooks

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not in place: {missing}")


def logical_kv(stack: Any, num_tokens: int, layers: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A seeded draw of ``num_tokens`` tokens' latent rows and indexer pages."""
    pool = stack.kv_pool
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn((layers, num_tokens, *pool.kv_buffer[0].shape[1:]), generator=generator)
    index_page = pool.index_k_with_scale_buffer[0].shape[1:]
    pages = num_tokens // stack.config.page_size
    indexer = torch.randint(0, 256, (layers, pages, *index_page), generator=generator)
    return latent.to(pool.kv_buffer[0].dtype), indexer.to(torch.uint8)


def store_layer(stack: Any, layer_id: int, batch: Sequence[BatchItem]) -> None:
    """Layer ``layer_id``'s stores over ``batch``: index K pages (owned ones), then the
    batch's latent in one ``set_mla_kv_buffer`` (the pool keeps its owned rows)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    page = stack.config.page_size
    for locs, (_, indexer) in batch:
        first_slots = locs[::page]
        owned_pages = torch.nonzero(stack.owned_mask(first_slots)).squeeze(1)
        page_rows = stack.physical_rows(first_slots) // page
        stack.kv_pool.index_k_with_scale_buffer[layer_id][page_rows] = indexer[layer_id][owned_pages]
    locs = torch.cat([locs for locs, _ in batch])
    rows = torch.cat([latent[layer_id] for _, (latent, _) in batch])
    rank = stack.config.kv_lora_rank
    layer = RadixAttention(num_heads=1, head_dim=rows.shape[-1], scaling=1.0, num_kv_heads=1, layer_id=layer_id)
    stack.kv_pool.set_mla_kv_buffer(layer, KVWriteLoc(locs), rows[..., :rank], rows[..., rank:])


def forward(stack: Any, batch: Sequence[BatchItem], on_layer: Callable[[int], None] = lambda _: None) -> None:
    """Every layer's stores over ``batch`` (``on_layer`` after each), then the forward's
    end, as the model-forward hook reports it."""
    from sglang_cp_hicache.v0_5_23.mem_cache.layer_backup import notify_forward_end

    for layer in range(stack.config.layer_num):
        store_layer(stack, layer, batch)
        on_layer(layer)
    notify_forward_end(stack.kv_pool)


# ------------------------------------------------------------------------------- bench
@dataclass
class BackupTimes:
    """Per batch, seconds on the scheduler thread: before the forward (reservations),
    inside it (the layer hooks' backup work) and after it (the backup part of the insert
    plus the flush that submits writes)."""

    pre_forward_s: List[float] = field(default_factory=list)
    in_forward_s: List[float] = field(default_factory=list)
    post_forward_s: List[float] = field(default_factory=list)


class _Timer:
    """Wraps bound methods on an instance, adding their wall time to ``total``."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, obj: Any, name: str) -> None:
        real = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(obj, name, timed)


def time_backups(ctx: RankContext, per_layer: bool, bench: Dict[str, int]) -> BackupTimes:
    """One mode over ``bench`` (layers, batches, nodes, pages, seed) on this rank."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_sharded_stack
    from sglang_cp_hicache.v0_5_23.mem_cache.layer_backup import layer_backup_of

    apply_plugin_hooks()
    page = 64
    node_tokens = bench["pages"] * page
    config = StackConfig(
        layer_num=bench["layers"],
        device_pages_per_rank=bench["nodes"] * bench["pages"] // ctx.world_size + bench["pages"] + 2,
        cp_shared_kv=per_layer,
    )
    times = BackupTimes()
    empty = torch.empty((0,), dtype=torch.int64)
    with build_sharded_stack(ctx, config) as stack:
        backup = layer_backup_of(stack.cache)
        post = _Timer()  # the backup part of the insert and the flush's submission
        post.wrap(stack.cache, "_execute_kv_backup")
        post.wrap(stack.controller, "start_writing")
        in_forward = _Timer()
        if backup is not None:
            in_forward.wrap(backup.pipeline, "backup_layer")
        for index in range(bench["batches"]):
            tokens = [
                list(range(node_tokens * (index * bench["nodes"] + n) + 1, node_tokens * (index * bench["nodes"] + n + 1) + 1))
                for n in range(bench["nodes"])
            ]
            allocs = [stack.alloc_extend(empty, node_tokens, rotation_base=n % ctx.world_size) for n in range(bench["nodes"])]
            batch = [(locs, logical_kv(stack, node_tokens, config.layer_num, bench["seed"] + n)) for n, (locs, _) in enumerate(allocs)]
            start = time.perf_counter()
            if backup is not None:
                for n, (locs, base) in enumerate(allocs):
                    backup.reserve(f"b{index}n{n}", locs, base)
            times.pre_forward_s.append(time.perf_counter() - start)
            in_forward.total = 0.0
            forward(stack, batch)
            times.in_forward_s.append(in_forward.total)
            post.total = 0.0
            for node, (locs, base) in zip(tokens, allocs):
                stack.insert(node, locs, base)
            stack.cache.flush_pending_backups()
            times.post_forward_s.append(post.total)
            stack.cache.writing_check()  # the acks, then constant occupancy for the next batch
            stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
            stack.cache.evict_host(stack.kv_host_pool.logical_size)
    return times


__all__ = ["BackupTimes", "BatchItem", "apply_plugin_hooks", "forward", "logical_kv", "store_layer", "time_backups"]
