"""A prefill forward's KV stores on the REAL 0.5.23 sharded stack, for per-layer backup.

:func:`store_layer` is what one layer of a forward stores over a batch (the DSA indexer's
index K pages, then the MLA latent of the whole batch in one call of the sharded pool's own
``set_mla_kv_buffer``, after which the plugin's store hook reports the layer);
:func:`forward` runs every layer and reports the forward's end. :func:`extend_batch` and
:func:`forward_batch_of` build what ``Scheduler.run_batch`` and ``ModelRunner.forward``
receive (a real ``ScheduleBatch`` of real ``Req`` objects admitted by a ``PrefillAdder`` and
allocated by ``alloc_for_extend``, and its ``ForwardBatch``), for driving the plugin's hooks
of those two methods. :func:`time_backups` is the rank side of
``benchmark/bench_per_layer_backup.py``'s 0.5.23 mode: upstream's all-layer path (flag off)
and the plugin's per-layer path (flag on) over the same trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.dist import RankContext
from sglang_cp_hicache.testing.v0_5_23.owned_kv import logical_kv
from sglang_cp_hicache.testing.v0_5_23.stack import apply_plugin_hooks

#: ``--max-prefill-tokens``' default: the input tokens one prefill batch may carry.
MAX_PREFILL_TOKENS = 16384

#: One request of a forward batch: its logical locs and its logical KV, (latent
#: [layer, token, 1, dim], indexer [layer, page, bytes]) identical on every rank.
BatchItem = Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def host_latent_layer(kv_host: Any, host_layer: int) -> torch.Tensor:
    """Host layer ``host_layer`` of the MLA host pool's latent, ``[rows, 1, dim]``, read as
    its layout stores it (layer_first ``[layer, row, ...]``, page_first ``[row, layer, ...]``)."""
    buffer = kv_host.kv_buffer
    return buffer[host_layer] if kv_host.layout == "layer_first" else buffer[:, host_layer]


def host_indexer_layer(indexer_host: Any, host_layer: int) -> torch.Tensor:
    """Host layer ``host_layer`` of the DSA indexer host pool, ``[pages, bytes]``
    (layer_first ``[layer, page, bytes]``, page_first ``[page, layer, 1, bytes]``)."""
    buffer = indexer_host.index_k_with_scale_buffer
    return buffer[host_layer] if indexer_host.layout == "layer_first" else buffer[:, host_layer, 0]


def host_mismatches(stack: Any, locs: torch.Tensor, host_locs: torch.Tensor, layers: Sequence[int]) -> List[str]:
    """On a sharded stack, this rank's owned host rows (latent) and pages (indexer) of the
    logical device slots ``locs``, backed up to the logical host slots ``host_locs``, that
    differ from the device's, one line each over ``layers`` (none: the bytes came back)."""
    page = stack.config.page_size
    owned = stack.owned_mask(locs)
    device_rows = stack.physical_rows(locs)
    host_rows = stack.placement.local_index(host_locs[owned])
    first = torch.arange(0, len(locs), page)
    owned_pages = stack.owned_mask(locs[first])
    device_pages = stack.physical_rows(locs[first]) // page
    host_pages = stack.placement.local_index(host_locs[first][owned_pages]) // page
    bad = []
    for layer in layers:
        device = stack.kv_pool.kv_buffer[layer][device_rows]
        host = host_latent_layer(stack.kv_host_pool, layer)[host_rows].view(device.dtype).reshape(device.shape)
        bad += [f"layer {layer} latent row {int(r)}" for r in device_rows[(host != device).flatten(1).any(1)]]
        device_index = stack.kv_pool.index_k_with_scale_buffer[layer][device_pages]
        host_index = host_indexer_layer(stack.indexer_host_pool, layer)[host_pages]
        bad += [f"layer {layer} indexer page {int(p)}" for p in device_pages[(host_index != device_index).any(1)]]
    return bad


def fresh_write_plan(pool: Any) -> None:
    """A new extend batch for the sharded pool's write plan. Upstream caches a batch's
    owner filter keyed by the locs tensor's address and length and a per-batch epoch that
    ``begin_shard_extend`` bumps (``page_interleave_pool.py:577-592``); forwards on CPU run
    no prefix gather, so they bump it here: else a new locs tensor at a freed one's address,
    of the same length, takes the stale plan and its KV lands in another batch's rows."""
    pool._epoch += 1


def store_pool_layer(stack: Any, pool: Any, layer_id: int, batch: Sequence[BatchItem]) -> None:
    """Layer ``layer_id``'s stores over ``batch`` into ``pool`` (the target's, or the MTP
    draft's placed like it): index K pages (owned ones), then the batch's latent in one
    ``set_mla_kv_buffer`` (the pool keeps its owned rows)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    for locs, (_, indexer) in batch:
        page_positions, page_rows = stack.owned_pages(locs)
        pool.index_k_with_scale_buffer[layer_id][page_rows] = indexer[layer_id][page_positions]
    locs = torch.cat([locs for locs, _ in batch])
    rows = torch.cat([latent[layer_id] for _, (latent, _) in batch])
    rank = stack.config.kv_lora_rank
    layer = RadixAttention(num_heads=1, head_dim=rows.shape[-1], scaling=1.0, num_kv_heads=1, layer_id=layer_id)
    pool.set_mla_kv_buffer(layer, KVWriteLoc(locs), rows[..., :rank], rows[..., rank:])


def store_layer(stack: Any, layer_id: int, batch: Sequence[BatchItem]) -> None:
    """Layer ``layer_id``'s stores over ``batch`` in the target's pool (a new locs tensor
    per call: a fresh write plan)."""
    fresh_write_plan(stack.kv_pool)
    store_pool_layer(stack, stack.kv_pool, layer_id, batch)


def extend_batch(stack: Any, prompts: Sequence[Sequence[int]], rid_prefix: str = "r") -> Any:
    """A real extend ``ScheduleBatch`` over ``prompts`` (one ``Req`` each, rids
    ``<rid_prefix><i>``) as the scheduler hands it to ``run_batch``: each request matched
    (``init_next_round_input``) and admitted by a ``PrefillAdder`` (its lock taken), then
    SGLang's ``alloc_for_extend`` (req rows, KV slots, rotation bases); ``out_cache_loc`` is
    the batch's new logical slots in request order. Raises if one is not admitted."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocation import alloc_for_extend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache = stack.cache
    adder = PrefillAdder(
        stack.config.page_size, cache, stack.allocator, ScheduleBatch(reqs=[], batch_is_full=False), 0.0,
        MAX_PREFILL_TOKENS, None,
    )  # fmt: skip
    for index, prompt in enumerate(prompts):
        req = Req(
            rid=f"{rid_prefix}{index}",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        req.init_next_round_input(cache)
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        if not adder.can_run_list or adder.can_run_list[-1] is not req:
            raise RuntimeError(f"request {req.rid} was not admitted")
    reqs = adder.can_run_list
    batch = ScheduleBatch(
        reqs=reqs,
        req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator,
        tree_cache=cache,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        device="cpu",
    )
    batch.forward_mode = ForwardMode.EXTEND  # what prepare_for_extend sets around the allocation
    batch.prefix_lens = [req.prefix_len for req in reqs]
    batch.extend_lens = [req.extend_len for req in reqs]
    batch.seq_lens_cpu = torch.tensor([req.extend_end for req in reqs], dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    batch.extend_num_tokens = sum(batch.extend_lens)
    batch.out_cache_loc, batch.req_pool_indices, _ = alloc_for_extend(batch)
    batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    return batch


def finish_request(cache: Any, req: Any) -> None:
    """After the forward of a request's last chunk, as a PD prefill scheduler finishes it:
    the insert (``checkpoint_kv_cache``), then ``release_kv_cache`` and ``finish``."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    req.output_ids.append(0)
    checkpoint_kv_cache(req, cache)
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, cache, checkpoint=True)
    cache.finish(req.cache_request_handle, CacheRequestOutcome.SUCCESS)


def forward_batch_of(stack: Any, batch: Any) -> Any:
    """The ``ForwardBatch`` ``ModelRunner.forward`` receives for ``batch`` (its required
    fields: mode, sizes, rows and slots; 0.5.23's holds no pool, the runner does)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    return ForwardBatch(
        forward_mode=batch.forward_mode,
        batch_size=len(batch.reqs),
        input_ids=torch.zeros(batch.extend_num_tokens, dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=batch.seq_lens,
        out_cache_loc=batch.out_cache_loc,
        seq_lens_sum=batch.seq_lens_sum,
        seq_lens_cpu=batch.seq_lens_cpu,
    )


def forward(stack: Any, batch: Sequence[BatchItem], on_layer: Callable[[int], None] = lambda _: None) -> None:
    """Every layer's stores over ``batch`` (``on_layer`` after each), then the forward's
    end, as the model-forward hook reports it."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import notify_forward_end

    for layer in range(stack.config.layer_num):
        store_layer(stack, layer, batch)
        on_layer(layer)
    notify_forward_end(stack.kv_pool)


# ------------------------------------------------------------------------------- bench
@dataclass
class BackupTimes:
    """Per batch, seconds on the scheduler thread: before the forward (reservations),
    inside it (the layer hooks' backup work) and after it (the backup part of the insert
    plus the flush that submits writes); and per batch the owned host rows and indexer
    pages, after the acks, whose bytes differ from the device's (:func:`host_mismatches`)."""

    pre_forward_s: List[float] = field(default_factory=list)
    in_forward_s: List[float] = field(default_factory=list)
    post_forward_s: List[float] = field(default_factory=list)
    host_mismatches: List[int] = field(default_factory=list)


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


def time_backups(ctx: RankContext, per_layer: bool, bench: Dict[str, Any]) -> BackupTimes:
    """One mode over ``bench`` (layers, batches, nodes, pages, seed, host layout) on this rank."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    apply_plugin_hooks()
    page = 64
    node_tokens = bench["pages"] * page
    config = StackConfig(
        layer_num=bench["layers"],
        device_pages_per_rank=bench["nodes"] * bench["pages"] // ctx.world_size + bench["pages"] + 2,
        cp_shared_kv=per_layer,
        mem_layout=bench["layout"],
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
            stack.cache.writing_check()  # the acks, then the bytes, then constant occupancy
            bad = 0
            for node, (locs, _) in zip(tokens, allocs):
                host_locs = stack.cache.tree_core.node_by_id(stack.match(node).last_device_node).component_data[
                    ComponentType.FULL
                ].host_value
                bad += len(host_mismatches(stack, locs, host_locs, range(config.layer_num)))
            times.host_mismatches.append(bad)
            stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
            stack.cache.evict_host(stack.kv_host_pool.logical_size)
    return times


__all__ = [
    "BackupTimes",
    "BatchItem",
    "extend_batch",
    "finish_request",
    "forward",
    "forward_batch_of",
    "fresh_write_plan",
    "host_indexer_layer",
    "host_latent_layer",
    "host_mismatches",
    "store_layer",
    "time_backups",
]
