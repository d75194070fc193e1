"""One rank's per-layer HiCache backup round trip on SGLang 0.5.23's REAL sharded stack, on
CPU or on the GPU check host (``scripts/gpu/device_check.py --sglang 0.5.23``).

The scenario of ``multi_rank/v0_5_23/backup/test_per_layer_backup_multi_rank.py`` with a device:
the stack (``stack.build_sharded_stack``, the plugin's flag on, its hooks applied) holds
host slots reserved before a forward for two requests, ``A`` (five pages, every rank owns
some) and ``C`` (one page on the last rank: every other rank owns none and must still ack).
The forward stores each layer through the sharded pool's own ``set_mla_kv_buffer`` (the
store hook copies that layer's owned rows on the L2 engine's D2H stream, after an event
on the forward's stream), after a stall on the forward's stream (``stall_cycles``, CUDA
only) so a copy not ordered after the stores would read the bytes from before them. Then:
one ack per forward, only after the last layer; the insert, the acks consumed by
``writing_check`` on every rank; a device wipe; a load-back checked byte for byte per
layer against the logical KV; the free counts back. On CUDA, events time the overlap:
how long before the last layer's stores layer 0's copy was done.

Host layouts (:data:`LAYOUTS`): ``layer_first`` (upstream's one-layer D2H ops) and
``page_first`` (0.5.23's default: the JIT one-layer kernel over per-layer views of the
latent and the DSA indexer host buffers; the CPU runtime's stand-ins on CPU).

Planted faults (:func:`plants_for`), each run on every layout and each must break the
contract: ``layer_copy_dropped`` (layer 0's D2H skipped, its ack still sent) on every
device; ``missing_wait`` (the D2H stream no longer waits for a layer's stores) on CUDA
only: on CPU copies are synchronous and a missing wait races nothing.

On CUDA the page_first stack needs upstream's JIT kernel built on the host (nvcc, ninja, a
C++ compiler and libcudart under ``CUDA_HOME``; the product refuses page_first at start-up
without it). :func:`probe_page_first_jit` asks upstream's ``can_use_hicache_jit_kernel``
what the stack's host pools would ask, so the GPU check can report that round trip as not
run, with upstream's reason, instead of failing on a stack the product refuses.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.forward_timing import ForwardTiming
from sglang_cp_hicache.testing.v0_5_23.owned_kv import LogicalKV, logical_kv, owned_row_mismatches

PAGE = 64
LAYERS = 3
SEED = 20261205
#: Request -> (first token id, pages); rotation bases 0 and ``cp - 1``.
REQUESTS = {"A": (1, 5), "C": (20_001, 1)}
#: The per-layer backup's host layouts, each with its own round trip and planted faults.
LAYOUTS = ("layer_first", "page_first")
#: The planted faults per device (names for :func:`planted`), see the module doc.
PLANTS_CPU = ("layer_copy_dropped",)
PLANTS_CUDA = ("layer_copy_dropped", "missing_wait")


def plants_for(device: str) -> tuple:
    return PLANTS_CUDA if device == "cuda" else PLANTS_CPU


#: The hook targets the round trip runs through; the others (scheduler, model runner,
#: server entrypoints) import packages the GPU check's bundle does not carry (uvloop,
#: uvicorn, fastapi, setproctitle), so they are verified only where already imported.
ROUND_TRIP_TARGETS = "sglang.srt.mem_cache."


def apply_check_hooks() -> None:
    """The plugin's hooks applied in this process; those on :data:`ROUND_TRIP_TARGETS`
    verified in place, importing their modules (``stack.apply_plugin_hooks``
    imports every target, ``sglang.srt.entrypoints.engine`` among them): the GPU check's
    own shim."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_23.hooks import HOOKS, RESOLUTION_STEPS, missing_hooks, missing_resolution_steps

    register()
    HookRegistry.apply_hooks()
    ours = [spec for spec in HOOKS if spec.dotted_target.startswith(ROUND_TRIP_TARGETS)]
    others = [spec for spec in HOOKS if not spec.dotted_target.startswith(ROUND_TRIP_TARGETS)]
    missing = missing_hooks(ours) + missing_hooks(others, import_targets=False)
    missing += missing_resolution_steps(RESOLUTION_STEPS, import_targets=False)
    if not ours or missing:
        raise RuntimeError(f"plugin hooks not in place: {missing or 'no mem_cache hook'}")


class PreparedStores:
    """One forward's stores over ``batch`` (``(logical locs, logical KV on the device)`` per
    request), computed ahead so each layer's stores issue without a host sync: one locs
    tensor for every layer (upstream caches the sharded pool's owner filter per batch, so
    only layer 0's store computes it), owned index-K page rows and values gathered once.
    Then a write stream that does not wait for a layer's stores reads the bytes from before
    them while the forward's stream is stalled (layers after 0 at least)."""

    def __init__(self, stack: Any, batch: List[tuple]) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import fresh_write_plan

        self._stack = stack
        self.locs = torch.cat([locs for locs, _ in batch])
        self.latent = torch.cat([latent for _, (latent, _) in batch], dim=1)  # [layer, token, 1, dim]
        page_rows, page_values = [], []
        for locs, (_, indexer) in batch:
            positions, rows = stack.owned_pages(locs)
            page_rows.append(rows)
            page_values.append(indexer[:, positions])
        self.page_rows = torch.cat(page_rows)
        self.page_values = torch.cat(page_values, dim=1)
        dim = self.latent.shape[-1]
        self.layers = [
            RadixAttention(num_heads=1, head_dim=dim, scaling=1.0, num_kv_heads=1, layer_id=layer)
            for layer in range(self.latent.shape[0])
        ]
        fresh_write_plan(stack.kv_pool)  # a new batch for the pool's owner filter

    def store(self, layer: int) -> None:
        """Layer ``layer``'s stores: owned index-K pages, then the batch's latent in one
        ``set_mla_kv_buffer`` (whose store hook backs the layer up)."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        pool, rank = self._stack.kv_pool, self._stack.config.kv_lora_rank
        pool.index_k_with_scale_buffer[layer][self.page_rows] = self.page_values[layer]
        rows = self.latent[layer]
        pool.set_mla_kv_buffer(self.layers[layer], KVWriteLoc(self.locs), rows[..., :rank], rows[..., rank:])


def stack_config(device: str, layout: str) -> Any:
    """The round trip's stack on ``device`` with ``layout`` host pools."""
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

    return StackConfig(layer_num=LAYERS, cp_shared_kv=True, mem_layout=layout, device=device)


def _stack(ctx: Any, device: str, layout: str) -> Any:
    from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack

    apply_check_hooks()
    return build_sharded_stack(ctx, stack_config(device, layout))


def _settle(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _on_device(kv: LogicalKV, device: str) -> LogicalKV:
    return LogicalKV(*(t.to(device) for t in kv))


def round_trip(
    ctx: Any, device: str = "cpu", layout: str = "layer_first", stall_cycles: int = 0,
    keep_stacks: Optional[List[Any]] = None,
) -> Dict[str, Any]:  # fmt: skip
    """The scenario on this rank (every rank of ``ctx.cp_group`` together). Returns what
    :func:`round_trip_problems` judges: per request its owned pages, the acks before the
    last layer and after the forward, pending flags after ``writing_check``, load-back
    mismatches, free counts, and ``overlap_ms`` (CUDA). ``keep_stacks`` receives the stack
    (SGLang pins host pools and never unregisters them: a GPU process keeps them alive)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    report: Dict[str, Any] = {"layout": layout}
    timing = ForwardTiming(device)
    stack = _stack(ctx, device, layout)
    try:
        backup = layer_backup_of(stack.cache)
        if backup is None:
            raise RuntimeError(f"no per-layer backup attached ({layout})")
        start = (stack.device_available(), stack.host_available())
        plan = _reserve(ctx, stack, backup, device)
        report["owned_pages"] = {rid: int(stack.owned_mask(locs[::PAGE]).sum()) for rid, _, locs, _, _ in plan}
        report.update(_forward(stack, plan, timing, stall_cycles))
        report.update(_back_up(stack, plan, device))
        report["loaded"] = _load_back(stack, plan, device)
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        report["free_counts"] = [list(start), [stack.device_available(), stack.host_available()]]
        report["overlap_ms"] = timing.overlap_ms()
    finally:
        stack.close()
        if keep_stacks is not None:
            keep_stacks.append(stack)
    return report


#: One request of the round trip: (rid, tokens, logical locs, rotation base, logical KV).
Planned = Tuple[str, List[int], torch.Tensor, int, Any]


def _reserve(ctx: Any, stack: Any, backup: Any, device: str) -> List[Planned]:
    """Each request's slots allocated and its host slots reserved, before the forward."""
    empty = torch.empty((0,), dtype=torch.int64, device=device)
    plan = []
    for index, (rid, (first, pages)) in enumerate(REQUESTS.items()):
        tokens = list(range(first, first + pages * PAGE))
        base = 0 if index == 0 else ctx.world_size - 1
        locs, base = stack.alloc_extend(empty, len(tokens), rotation_base=base)
        backup.reserve(rid, locs, base)
        kv = _on_device(logical_kv(stack, len(tokens), LAYERS, SEED + first), device)
        plan.append((rid, tokens, locs, base, kv))
    return plan


def _forward(stack: Any, plan: List[Planned], timing: ForwardTiming, stall_cycles: int) -> Dict[str, Any]:
    """The forward's stores layer by layer (each layer's compute stalled first), the acks
    counted before the last layer and after the forward's end."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import notify_forward_end

    queue = stack.controller.ack_write_queue
    before = len(queue)
    report: Dict[str, Any] = {}
    stores = PreparedStores(stack, [(locs, kv) for _, _, locs, _, kv in plan])
    d2h = stack.controller.l2_transfer_engine.device_to_host_stream
    for layer in range(LAYERS):
        timing.stall(stall_cycles)  # the layer's compute, before its stores
        if layer == LAYERS - 1:
            report["acks_before_last_layer"] = len(queue) - before
        stores.store(layer)  # the store hook copies it on the D2H stream
        if layer == 0:
            timing.layer0_copied(d2h)
        if layer == LAYERS - 1:
            timing.last_layer_stored()
    notify_forward_end(stack.kv_pool)
    report["acks_after_forward"] = len(queue) - before
    return report


def _back_up(stack: Any, plan: List[Planned], device: str) -> Dict[str, Any]:
    """The inserts claim the reservations; the ack settles them on every rank."""
    for _, tokens, locs, base, _ in plan:
        stack.insert(tokens, locs, base)
    stack.cache.flush_pending_backups()
    _settle(device)  # the scheduler polls until the copies end; the check waits once
    stack.cache.writing_check()  # MIN all-reduce: every rank's ack, a zero-owned one too
    nodes = {rid: stack.cache.tree_core.node_by_id(stack.match(tokens).last_device_node) for rid, tokens, *_ in plan}
    return {
        "pending_after_ack": {rid: n.write_through_pending_id is not None for rid, n in nodes.items()},
        "backed_up": {rid: bool(n.backuped) for rid, n in nodes.items()},
    }


def _load_back(stack: Any, plan: List[Planned], device: str) -> Dict[str, Any]:
    """Device evicted and wiped, then each request loaded back and compared layer by layer."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    for layer in range(LAYERS):  # the load-back must write every byte it is checked on
        stack.kv_pool.kv_buffer[layer].zero_()
        stack.kv_pool.index_k_with_scale_buffer[layer].zero_()
    loaded: Dict[str, Any] = {}
    for rid, tokens, _, _, kv in plan:
        match = stack.match(tokens)
        if not stack.cache.load_back(match.best_match_node):
            loaded[rid] = [f"load_back refused ({match.host_hit_length} host tokens)"]
            continue
        stack.cache.ready_to_load_host_cache()
        _settle(device)
        stack.cache.loading_check()
        reloaded = stack.cache.path_device_indices(stack.match(tokens).last_device_node)
        loaded[rid] = owned_row_mismatches(stack, reloaded, kv, layers=range(LAYERS))
    return loaded


def round_trip_problems(reports: List[Dict[str, Any]]) -> List[str]:
    """What the ranks' reports break of the contract, one line each (none: it held): no
    ack before the last layer and one after the forward on every rank, every request
    published by the ack, load-backs byte-exact, free counts back, C owned by the last
    rank only, and on CUDA layer 0's copy done before the last layer's stores."""
    problems = []
    for rank, r in enumerate(reports):
        if r["acks_before_last_layer"] != 0:
            problems.append(f"rank {rank}: {r['acks_before_last_layer']} acks before the last layer's stores")
        if r["acks_after_forward"] != 1:
            problems.append(f"rank {rank}: {r['acks_after_forward']} acks after the forward (one expected)")
        for rid, pending in r["pending_after_ack"].items():
            if pending or not r["backed_up"][rid]:
                problems.append(f"rank {rank} {rid}: not published after the ack")
        for rid, bad in r["loaded"].items():
            if bad:
                problems.append(f"rank {rank} {rid}: load-back not byte-exact ({len(bad)}: {bad[:3]})")
        start, end = r["free_counts"]
        if start != end:
            problems.append(f"rank {rank}: free counts {start} -> {end}")
        overlap = r.get("overlap_ms")  # CUDA only: layer 0 on host while the forward still ran
        if overlap is not None and overlap <= 0:
            problems.append(f"rank {rank}: layer 0's copy ended {-overlap:.3f} ms after the last layer's stores")
    owners_of_c = [rank for rank, r in enumerate(reports) if r["owned_pages"]["C"]]
    if owners_of_c != [len(reports) - 1]:
        problems.append(f"C owned by ranks {owners_of_c}, expected [{len(reports) - 1}] (the others own none)")
    if any(r["owned_pages"]["A"] == 0 for r in reports):
        problems.append("A: a rank owns none of its pages")
    return problems


def stale_loads(reports: List[Dict[str, Any]]) -> int:
    """Load-backs that did not come back byte-exact, over every rank."""
    return sum(1 for r in reports for bad in r["loaded"].values() if bad)


# ------------------------------------------------------------------ the JIT kernel on this host
def page_first_jit_operands(config: Any) -> Dict[str, Tuple[int, int]]:
    """``(element bytes, page size)`` of each ``can_use_hicache_jit_kernel`` call the
    page_first stack's host pools decide on: the MLA latent rows (``MLATokenToKVPoolHost``
    at construction, its ``can_use_jit``) and the DSA indexer's pages as items
    (``l2_transfer.per_layer_problem``). An indexer row is the fp8 K plus one fp32 scale
    per 128 values."""
    index_row = config.index_head_dim + config.index_head_dim // 128 * 4
    return {
        "latent": (config.kv_cache_dim * config.dtype.itemsize, config.page_size),
        "indexer": (config.page_size * index_row, 1),
    }


def jit_toolchain() -> Dict[str, Optional[str]]:
    """What upstream's JIT build runs (``sglang/kernels/jit/utils/compile``): ``ninja`` from
    PATH, nvcc and libcudart / the CUDA headers under ``CUDA_HOME`` (else nvcc's on PATH, else
    /usr/local/cuda), the host compiler ``$CXX`` or ``c++``; each path, None where missing.
    Informative only: a cached build (``SGLANG_JIT_CACHE_DIR``) needs none of them."""
    from sglang.kernels.jit.utils.compile import toolchain

    home = toolchain.cuda_home()

    def existing(path: str) -> Optional[str]:
        return path if os.path.exists(path) else None

    return {
        "ninja": shutil.which("ninja"),
        "nvcc": existing(toolchain.device_compiler_path()),
        "c++": shutil.which(toolchain.host_compiler_path()),
        "cuda_runtime.h": existing(os.path.join(home, "include", "cuda_runtime.h")),
        "libcudart.so": existing(os.path.join(home, "lib64", "libcudart.so")),
    }


class _Warnings(logging.Handler):
    """The messages a logger warns with while attached (upstream logs why a JIT kernel
    cannot be used, then returns False)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def probe_page_first_jit(
    can_use: Optional[Callable[..., bool]] = None, toolchain: Optional[Callable[[], dict]] = None
) -> Dict[str, Any]:
    """Whether upstream's JIT one-layer HiCache kernel serves the page_first round trip's
    host pools on this host: ``can_use_hicache_jit_kernel`` (``can_use``) per operand of
    :func:`page_first_jit_operands`, as the pools call it (building the kernel, or loading a
    cached build). Returns ``available``, ``reason`` (one line: the first operand refused,
    upstream's first warning, what :func:`jit_toolchain` found missing; None when
    available), ``operands``, upstream's ``warnings`` in full and the ``toolchain``. The last
    warning is upstream's verdict (a TMA kernel that did not load warns before it)."""
    from sglang.kernels.ops.kvcache import hicache

    can_use = can_use or hicache.can_use_hicache_jit_kernel
    operands = page_first_jit_operands(stack_config("cuda", "page_first"))
    refused, warnings = [], _Warnings()
    logger = logging.getLogger(hicache.__name__)
    logger.addHandler(warnings)
    try:
        for name, (element_size, page_size) in operands.items():
            if not can_use(element_size=element_size, page_size=page_size):
                refused.append(f"{name} {element_size}-byte items")
    finally:
        logger.removeHandler(warnings)
    tools = (toolchain or jit_toolchain)()
    reason = None
    if refused:
        said = warnings.messages[-1].strip().splitlines()[0][:300] if warnings.messages else "no warning logged"
        missing = [tool for tool, path in tools.items() if path is None]
        reason = f"{', '.join(refused)}: {said}" + (f"; missing here: {', '.join(missing)}" if missing else "")
    return {
        "available": not refused, "reason": reason, "operands": {k: list(v) for k, v in operands.items()},
        "warnings": warnings.messages, "toolchain": tools,
    }  # fmt: skip


# ------------------------------------------------------------------ planted faults
def planted(name: str) -> Any:
    """The planted fault ``name`` as a context manager (see the module doc)."""
    from sglang_cp_hicache.testing.planted import events_without_wait, patched
    from sglang_cp_hicache.v0_5_23.backup.l2_transfer import DeviceBackupStreams, L2LayerTransfers

    if name == "missing_wait":
        return events_without_wait(DeviceBackupStreams)
    if name == "layer_copy_dropped":
        def drop_layer0(copy_layer: Callable) -> Callable:
            return lambda self, merged, layer_id: None if layer_id == 0 else copy_layer(self, merged, layer_id)

        return patched(L2LayerTransfers, "copy_layer", drop_layer0)
    raise ValueError(f"unknown planted fault {name!r}")


__all__ = [
    "LAYERS",
    "apply_check_hooks",
    "jit_toolchain",
    "LAYOUTS",
    "PLANTS_CPU",
    "PLANTS_CUDA",
    "PreparedStores",
    "page_first_jit_operands",
    "plants_for",
    "planted",
    "probe_page_first_jit",
    "round_trip",
    "round_trip_problems",
    "stack_config",
    "stale_loads",
]
