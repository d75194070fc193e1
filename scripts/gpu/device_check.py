"""Driver of scripts/gpu/device_check.sh: the offline one-GPU check of CP shared KV.

Six checks, one ``PASS``/``FAIL`` line, a JSON report (``$OUT/device_check.json`` when
``OUT`` is set, or ``GPU_CHECK_JSON``):

1. **self-test** (every rank): the server's startup self-test
   (``cp_shared_kv_selftest.run_selftest``) for bf16 and fp8 KV, both materialise
   strategies: SGLang's real readers and kernels (``GetKAndS``, ``GetK``/``GetS``,
   ``fast_topk_transform_fused``, FlashMLA sparse and kv, ``dequantize_k_cache_paged``) on
   a replicated pool vs the shared path, bitwise.
2. **twin** (every rank): one prefill forward with a cached prefix, replicated vs shared,
   through SGLang's real ``NSATokenToKVPool`` (Triton stores and index-K reads) and the
   plugin's real hook functions, with side-stream prefetch.
3. **bandwidth** (main process): one layer's owned shard of a GLM-5 prefix moved D2H and
   H2D as page gathers, against a pinned contiguous copy of the same bytes (the peak).
4. **hicache_jit** (main process, CUDA): ``sglang.jit_kernel.hicache``'s MLA one-layer
   transfer, which HiCache uses on CUDA when ``can_use_hicache_jit_kernel`` allows, on the
   owned pages, D2H and back, byte-exact.
5. **per_layer_backup** (main process): the plugin's per-layer HiCache D2H on SGLang's NSA
   device and host pools, every supported io backend/layout, byte-exact against SGLang's
   all-layer backup, and one layer's owned shard in GB/s (vs the pinned peak of check 3).

6. **per_layer_pipeline** (``--cp`` ranks, after the main-process checks): the per-layer
   backup round trip on the real CP stack (``testing/v0_5_12/per_layer_round_trip.py``,
   the multi-rank test's scenario): reservations before a forward, each layer's stores
   after a stall on the forward's stream and then its backup on the write stream, an
   all-layer backup mid-forward, the acks (same on every rank, after the last layer, a
   zero-owned rank too), a device wipe and a load-back byte-exact per layer; with the
   overlap of layer 0's copy and the forward, from CUDA events. Its ranks have their own
   time limit (``PIPELINE_TIMEOUT_S``).

NCCL refuses two ranks on one GPU, so the CP ranks are ``--cp`` processes on the one
device with a gloo CP group (gloo moves CUDA tensors through host staging). ``--device
cpu`` runs the same checks with the CPU runtime's reference kernels.

``--sglang 0.5.23`` checks the 0.5.23 line instead, on ``--cp`` gloo ranks, for every KV
format the plugin admits on Hopper (``flashmla_sparse`` over bf16, ``flashmla_kv`` over
packed fp8), the same checks on both devices (CUDA: SGLang's kernels from the 0.5.23
bundle, loaded first; CPU: the torch stand-ins): the startup self-test (CUDA: per top-k
path), the sharded-vs-replicated twins of the target and MTP draft extends
(``testing/v0_5_23/device_twins.py``), the per-layer backup round trip on the real sharded
stack (``testing/v0_5_23/layer_round_trip.py``; layer_first and page_first, each planted;
on CUDA page_first only where upstream's JIT HiCache kernel builds on the host, probed
first, else its round trip and plants are named NOT RUN with the reason in the line),
then sglang-kernel's kvcacheio MLA transfers and the owned-shard D2H/H2D against pinned
peak (>= 80 % on CUDA) in the main process; and a planted fault per check, run here, that
must be caught. See docs/gpu_checks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, List, Mapping, Optional, Sequence

STRATEGIES = ("all_reduce", "all_gather")
KV_KINDS = ("bf16", "fp8")
PAGE_SIZE = 64
INDEX_PAGE_BYTES = PAGE_SIZE * 132
KV_TOKEN = {"bf16": ("bfloat16", (1, 576), 1152), "fp8": ("uint8", (1, 656), 656)}


@dataclass(frozen=True)
class CheckOptions:
    device: str
    cp_size: int
    timeout_s: float


def variants() -> List[tuple]:
    return [(strategy, prefetch) for strategy in STRATEGIES for prefetch in (False, True)]


def _config_and_pool(device: str):
    from sglang_cp_hicache.testing.reference_sparse_mla import (
        TINY_CONFIG,
        ReferenceNSAPool,
        SparseMLAConfig,
    )
    from sglang_cp_hicache.testing.v0_5_12.shared_kv_twin import TwinBatchSpec

    if device == "cpu":
        return TINY_CONFIG, TwinBatchSpec(), ReferenceNSAPool, "torch reference pool"
    import torch

    config = SparseMLAConfig(
        num_layers=2, hidden_size=256, num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
        index_n_heads=4, index_head_dim=128, index_topk=64, page_size=64, kv_dtype=torch.bfloat16,
    )
    spec = TwinBatchSpec(prefix_lens=(64 * 5 + 37, 64 * 3, 0), extend_lens=(150, 90, 70), physical_pages=40)

    def sglang_pool(cfg, size, dev):
        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

        return NSATokenToKVPool(
            size, page_size=cfg.page_size, kv_lora_rank=cfg.kv_lora_rank, dtype=cfg.kv_dtype,
            qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=cfg.num_layers, device=dev,
            index_head_dim=cfg.index_head_dim, enable_memory_saver=False, kv_cache_dim=cfg.kv_cache_dim,
        )

    return config, spec, sglang_pool, "SGLang NSATokenToKVPool (Triton KV/index-K store and index-K read)"


def describe(options: CheckOptions) -> str:
    kernels = "SGLang kernels" if options.device == "cuda" else "torch reference kernels"
    return (
        f"plan: {options.cp_size} processes, gloo CP group, device={options.device}, {kernels}; "
        f"self-test kv={list(KV_KINDS)} x strategies={list(STRATEGIES)}; twin variants={variants()}; "
        "then owned-shard D2H/H2D bandwidth, the hicache JIT transfer and the per-layer "
        "backup in the main process; then the per-layer pipeline round trip on the CP stack "
        f"({[f'{b}/{l}' for b, l in PIPELINE_LAYOUTS]}); "
        "replicated vs shared KV (target + 1-layer MTP draft), identical outputs required"
    )


def check_rank(ctx: Any, options: dict) -> dict:
    """One rank: the twin comparison for every variant. ``options`` is
    ``asdict(CheckOptions)``: plain values unpickle in any launcher's child."""
    import torch

    from sglang_cp_hicache.testing.v0_5_12.shared_kv_twin import TwinRank, compare_shared_to_replicated

    options = CheckOptions(**options)
    config, spec, pool_factory, pool_name = _config_and_pool(options.device)
    device = "cuda:0" if options.device == "cuda" else "cpu"
    selftest = run_selftests(ctx, torch.device(device))
    side_stream = torch.cuda.Stream() if options.device == "cuda" else None
    twin = TwinRank(config, spec, ctx.cp_group, ctx.rank, ctx.world_size, device, pool_factory)
    results = compare_shared_to_replicated(twin, variants(), side_stream)
    return {"pool": pool_name, "results": [asdict(r) for r in results], "selftest": selftest}


def kv_geometry(kind: str):
    import torch

    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import PagedLayerGeometry

    dtype, shape, token_bytes = KV_TOKEN[kind]
    return PagedLayerGeometry(PAGE_SIZE, getattr(torch, dtype), shape, PAGE_SIZE * token_bytes, INDEX_PAGE_BYTES)


def run_selftests(ctx: Any, device) -> List[dict]:
    """The startup self-test for each KV kind and strategy; failures are recorded, not raised."""
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import (
        SharedKVSelfTestFailed,
        run_selftest,
    )
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

    layout = CpSharedKVLayout(ctx.world_size, ctx.rank, PAGE_SIZE)
    out = []
    for kind in KV_KINDS:
        for strategy in STRATEGIES:
            entry = {"kv": kind, "strategy": strategy}
            try:
                report = run_selftest(kv_geometry(kind), layout, ctx.cp_group, strategy, device)
                entry.update(ok=True, stages=list(dict.fromkeys(report.stages)), seconds=report.seconds)
            except SharedKVSelfTestFailed as exc:
                entry.update(ok=False, stage=exc.stage, error=str(exc))
            except Exception as exc:  # a kernel that would not run is a failure too
                entry.update(ok=False, stage="exception", error=f"{type(exc).__name__}: {exc}")
            out.append(entry)
    return out


# ----------------------------------------------------------------- main-process checks
@dataclass(frozen=True)
class ShardGeometry:
    """One layer's owned shard of a prefix: ``prefix_tokens / cp`` tokens in whole pages."""

    prefix_tokens: int = 131072
    cp_size: int = 8
    page_bytes: int = PAGE_SIZE * 1152 + INDEX_PAGE_BYTES  # GLM-5 bf16 latent + index K

    @property
    def owned_pages(self) -> int:
        return self.prefix_tokens // PAGE_SIZE // self.cp_size


def _timed(fn: Callable[[], None], device, repeats: int) -> float:
    """Best-of-``repeats`` seconds of ``fn`` (synchronised on CUDA)."""
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def shard_bandwidth(device, shard: ShardGeometry = ShardGeometry(), repeats: int = 5) -> dict:
    """GB/s of the owned-shard page gather D2H and scatter H2D vs pinned contiguous copies."""
    import torch

    pages = shard.owned_pages
    pin = device.type == "cuda"
    pool = torch.randint(0, 255, (3 * pages, shard.page_bytes), dtype=torch.uint8, device=device)
    owned = torch.randperm(3 * pages, device=device)[:pages]
    host = torch.empty(pages, shard.page_bytes, dtype=torch.uint8, pin_memory=pin)
    staging = torch.empty(pages, shard.page_bytes, dtype=torch.uint8, device=device)

    def d2h():
        torch.index_select(pool, 0, owned, out=staging)
        host.copy_(staging, non_blocking=pin)

    def h2d():
        staging.copy_(host, non_blocking=pin)
        pool.index_copy_(0, owned, staging)

    nbytes = pages * shard.page_bytes
    result = {
        "layer_shard_bytes": nbytes, "owned_pages": pages, "prefix_tokens": shard.prefix_tokens,
        "cp": shard.cp_size, "pinned": pin,
    }
    for name, fn in (
        ("d2h", d2h), ("h2d", h2d),
        ("peak_d2h", lambda: host.copy_(staging, non_blocking=pin)),
        ("peak_h2d", lambda: staging.copy_(host, non_blocking=pin)),
    ):
        seconds = _timed(fn, device, repeats)
        result[f"{name}_gbps"] = nbytes / seconds / 1e9
        result[f"{name}_ms"] = seconds * 1e3
    result["d2h_of_peak"] = result["d2h_gbps"] / result["peak_d2h_gbps"]
    result["h2d_of_peak"] = result["h2d_gbps"] / result["peak_h2d_gbps"]
    return result


def hicache_jit_transfer(device, shard: ShardGeometry = ShardGeometry(prefix_tokens=16384)) -> dict:
    """SGLang's JIT HiCache MLA one-layer transfer on the owned tokens: D2H then H2D."""
    if device.type != "cuda":
        return {"ran": False, "reason": "CUDA only (HiCache uses sgl_kernel's kvcacheio elsewhere)"}
    import torch

    from sglang.jit_kernel.hicache import can_use_hicache_jit_kernel, transfer_hicache_one_layer_mla

    element_size = 576 * 2  # GLM-5 bf16 latent row: the JIT path needs a multiple of 128 B
    if not can_use_hicache_jit_kernel(element_size=element_size):
        return {"ran": False, "ok": False, "reason": "can_use_hicache_jit_kernel returned False (see log)"}
    tokens = shard.owned_pages * PAGE_SIZE
    device_kv = torch.randn(3 * tokens, 576, device=device).to(torch.bfloat16)
    owned_pages = torch.randperm(3 * shard.owned_pages, device=device)[: shard.owned_pages]
    device_locs = (owned_pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=device)).flatten()
    host_kv = torch.zeros(tokens, 576, dtype=torch.bfloat16, pin_memory=True)
    host_locs = torch.arange(tokens, device=device)
    transfer_hicache_one_layer_mla(host_kv, host_locs, device_kv, device_locs)
    torch.cuda.synchronize(device)
    d2h_ok = torch.equal(host_kv, device_kv[device_locs].cpu())
    back = torch.zeros_like(device_kv)
    transfer_hicache_one_layer_mla(back, device_locs, host_kv, host_locs)
    torch.cuda.synchronize(device)
    h2d_ok = torch.equal(back[device_locs], device_kv[device_locs])
    seconds = _timed(lambda: transfer_hicache_one_layer_mla(host_kv, host_locs, device_kv, device_locs), device, 5)
    return {
        "ran": True, "ok": bool(d2h_ok and h2d_ok), "d2h_exact": bool(d2h_ok), "h2d_exact": bool(h2d_ok),
        "tokens": tokens, "d2h_gbps": tokens * element_size / seconds / 1e9,
    }


def _page_bytes(host_pool, index: int):
    """A host page (all layers) as bytes: random bf16 patterns include NaNs."""
    import torch

    return host_pool.get_data_page(index).contiguous().view(-1).view(torch.uint8)


def per_layer_backup(device, shard: ShardGeometry = ShardGeometry(), repeats: int = 5) -> dict:
    """The plugin's per-layer D2H (``mem_cache/memory_pool_host.py``) on SGLang's real NSA
    device pool and host pools, for each io backend/layout it supports: byte-exact against
    SGLang's own all-layer backup, and one layer's owned shard (KV + index K) in GB/s."""
    import torch

    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    from sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup import PER_LAYER_D2H_LAYOUTS

    layers, pages = 2, shard.owned_pages
    pool = NSATokenToKVPool(
        3 * pages * PAGE_SIZE, page_size=PAGE_SIZE, kv_lora_rank=512, dtype=torch.bfloat16,
        qk_rope_head_dim=64, layer_num=layers, device=str(device), index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=576,
    )
    for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]:
        buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, dtype=torch.uint8))
    device_pages = torch.randperm(3 * pages - 1)[:pages] + 1  # page 0 is padding
    tokens = lambda p: (p[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()  # noqa: E731
    device_locs, host_locs = tokens(device_pages), tokens(torch.arange(pages))
    results = {}
    for io_backend, layout in PER_LAYER_D2H_LAYOUTS:
        # The indices where the controller's move_indices leaves them for this backend.
        host_idx = host_locs.to(device) if io_backend == "kernel" else host_locs
        dev_idx = device_locs.to(device) if io_backend == "kernel" else device_locs
        try:
            # On a side stream, as the controller's write stream carries backups: the
            # page-first direct copies (cudaMemcpyBatchAsync) refuse the default stream.
            with _side_stream(device):
                results[f"{io_backend}/{layout}"] = _per_layer_against_all_layer(
                    pool, device, layers, shard, layout, io_backend, host_idx, dev_idx, repeats
                )
        except Exception as exc:  # one layout's failure must not hide the others' figures
            logging.exception("per-layer backup %s/%s raised", io_backend, layout)
            results[f"{io_backend}/{layout}"] = {"exact": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ran": True, "ok": all(r["exact"] for r in results.values()), "owned_pages": pages, **results}


#: Every host pool (or cache stack) the per-layer checks made, kept for the life of the
#: process: SGLang pins a host pool with an unchecked ``cudaHostRegister`` and never
#: unregisters it (a server's pools live as long as it does), so a freed pool's range
#: handed out again by malloc fails to register ("part or all of the requested memory
#: range is already mapped", seen on an H200 at the next layout's pool) and the error
#: surfaces at the next CUDA call.
LIVE_HOST_POOLS: List[Any] = []


def _side_stream(device) -> Any:
    """A fresh non-default stream made current (CUDA), or the CPU runtime's equivalent."""
    if device.type == "cuda":
        import torch

        return torch.cuda.stream(torch.cuda.Stream(device))
    from sglang_cp_hicache.testing.device import on_side_stream

    return on_side_stream()


def _per_layer_against_all_layer(
    pool, device, layers: int, shard: ShardGeometry, layout: str, io_backend: str,
    host_idx, dev_idx, repeats: int,
) -> dict:
    """One backend/layout: every layer backed up one by one vs SGLang's all-layer backup,
    byte for byte on the backed-up pages, and one layer's time."""
    import torch

    from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost, NSAIndexerPoolHost

    from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import layer_backup_for

    hosts = []
    for _ in range(2):  # per-layer, and SGLang's all-layer reference
        anchor = MLATokenToKVPoolHost(pool, 2.0, 0, PAGE_SIZE, layout)
        hosts.append([anchor, NSAIndexerPoolHost(pool, anchor, layout)])
    LIVE_HOST_POOLS.extend(hosts)
    for host in hosts[1]:
        host.backup_from_device_all_layer(pool, host_idx, dev_idx, io_backend)
    backups = [layer_backup_for(host) for host in hosts[0]]

    def one_layer(layer: int) -> None:
        for backup in backups:
            backup.backup_from_device_per_layer(pool, host_idx, dev_idx, layer, io_backend)

    for layer in range(layers):
        one_layer(layer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    exact = all(
        torch.equal(_page_bytes(ours, int(h)), _page_bytes(ref, int(h)))
        for ours, ref in zip(hosts[0], hosts[1])
        for h in host_idx.cpu()[::PAGE_SIZE]
    )
    seconds = _timed(lambda: one_layer(0), device, repeats)
    return {
        "exact": bool(exact), "layer_shard_gbps": shard.owned_pages * shard.page_bytes / seconds / 1e9,
        "layer_ms": seconds * 1e3,
    }


# ----------------------------------------------------------------- per-layer pipeline
#: The backends/layouts of the pipeline check: the launch script's (``scripts/glm5``) and
#: the page-first direct one (cudaMemcpyBatchAsync on the write/load streams).
PIPELINE_LAYOUTS = (("kernel", "layer_first"), ("direct", "page_first_direct"))
#: The forward's compute before each layer's stores (``torch.cuda._sleep`` cycles, a few
#: ms): long enough that a copy not ordered after the stores would read the old bytes.
STALL_CYCLES = 4_000_000
#: The pipeline ranks' limit: a rank that hangs costs this, not the whole check's budget.
PIPELINE_TIMEOUT_S = 90.0


def pipeline_rank(ctx: Any, options: dict) -> List[dict]:
    """One rank: the per-layer backup round trip on the real CP stack
    (``testing/v0_5_12/per_layer_round_trip.py``) per layout; an error is recorded."""
    from sglang_cp_hicache.testing.v0_5_12.per_layer_round_trip import per_layer_round_trip

    device = "cuda" if options["device"] == "cuda" else "cpu"
    runs = [(io_backend, layout, contextlib.nullcontext()) for io_backend, layout in PIPELINE_LAYOUTS]
    if device == "cuda":  # on CPU copies are synchronous: a missing wait races nothing there
        runs.append((*PIPELINE_LAYOUTS[0], _layer_wait_removed()))
    entries = []
    for io_backend, layout, plant in runs:
        try:
            with plant:
                report = per_layer_round_trip(
                    ctx, io_backend, layout, device=device, stall_cycles=STALL_CYCLES,
                    keep_stacks=LIVE_HOST_POOLS,
                )  # fmt: skip
            entries.append({"report": report})
        except Exception as exc:
            entries.append({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    return entries


def _layer_wait_removed() -> Any:
    """The negative control: the write stream no longer waits for a layer's stores before
    copying it (``ControllerLayerTransfers.new_event`` patched for the run), the fault the
    forward's stall is there to expose; the load-back must show stale bytes."""
    from sglang_cp_hicache.testing.planted import events_without_wait
    from sglang_cp_hicache.v0_5_12.mem_cache.hybrid_cache.cp_hybrid_cache_controller import (
        ControllerLayerTransfers,
    )

    return events_without_wait(ControllerLayerTransfers)


def per_layer_pipeline(options: CheckOptions, launch: Callable) -> dict:
    """The per-layer pipeline on ``cp`` ranks (real CP stack, controller, write/load streams
    and events): per layout, the contract's breaches (``round_trip_problems``; none: PASS)
    and each rank's overlap (layer 0 on host this many ms before the last layer's stores)."""
    from sglang_cp_hicache.testing.v0_5_12.per_layer_round_trip import round_trip_problems, stale_loads

    limited = dict(asdict(options), timeout_s=min(options.timeout_s, PIPELINE_TIMEOUT_S))
    try:
        per_rank = launch(options.cp_size, pipeline_rank, limited)
    except Exception as exc:  # a rank crashed or hung past the limit
        return {"ran": False, "ok": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"}

    def verdict(i: int) -> dict:
        entries = [rank_entries[i] for rank_entries in per_rank]
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if "error" in e]
        reports = [e["report"] for e in entries if "report" in e]
        return {
            "problems": errors or round_trip_problems(reports),
            "overlap_ms": [report["overlap_ms"] for report in reports],
            "raised": bool(errors),
        }

    layouts = {f"{b}/{l}": verdict(i) for i, (b, l) in enumerate(PIPELINE_LAYOUTS)}
    ok = not any(v["problems"] for v in layouts.values())
    if len(per_rank[0]) > len(PIPELINE_LAYOUTS):  # CUDA: the planted missing wait
        index = len(PIPELINE_LAYOUTS)
        control = verdict(index)
        reports = [rank_entries[index]["report"] for rank_entries in per_rank if "report" in rank_entries[index]]
        # Caught only by stale bytes in the load-back, with every rank reporting (not a crash).
        control["stale_loads"] = 0 if control["raised"] else len(stale_loads(reports))
        control["detected"] = control["stale_loads"] > 0
        layouts["negative_control"] = control
        ok = ok and control["detected"]
    return {"ran": True, "ok": ok, **layouts}


def summarize(
    per_rank: Sequence[dict], options: CheckOptions, wall_s: float, extra: Optional[dict] = None
) -> tuple[bool, List[str]]:
    failures = []
    extra = extra or {}
    for rank, report in enumerate(per_rank):
        for entry in report.get("selftest", ()):
            if not entry["ok"]:
                failures.append(
                    f"rank {rank} self-test {entry['kv']}/{entry['strategy']} stage {entry['stage']}: {entry['error']}"
                )
    failures.extend(main_process_failures(extra))
    for rank, report in enumerate(per_rank):
        for result in report["results"]:
            label = f"rank {rank} {result['strategy']}/prefetch={result['prefetch']}"
            if not result["identical"]:
                failures.append(f"{label}: max |shared - replicated| = {result['max_abs_diff']:.3g}")
            failures.extend(f"{label}: {p}" for p in result["pool_problems"])
            if result.get("draft_identical") is False:  # None: the twin ran no draft
                failures.append(f"{label}: draft max |shared - replicated| = {result['draft_max_abs_diff']:.3g}")
            failures.extend(f"{label}: draft {p}" for p in result.get("draft_pool_problems", ()))
    timings = ", ".join(
        f"{r['strategy']}/prefetch={int(r['prefetch'])} {max(rep['results'][i]['seconds'] for rep in per_rank) * 1e3:.0f} ms"
        for i, r in enumerate(per_rank[0]["results"])
    )
    head = f"cp={options.cp_size} device={options.device} pool={per_rank[0]['pool']}"
    selftests = len(per_rank[0].get("selftest", ()))
    if failures:
        lines = [f"FAIL shared-KV != replicated ({head}): {failures[0]} (+{len(failures) - 1} more)"]
    else:
        lines = [
            f"PASS shared-KV == replicated ({head}, {selftests} self-tests and "
            f"{len(variants())} twin variants x {options.cp_size} ranks)"
        ]
    selftest_s = max((e.get("seconds", 0.0) for rep in per_rank for e in rep.get("selftest", ())), default=0.0)
    lines.append(f"timings: {timings}; slowest self-test {selftest_s:.2f} s; total {wall_s:.1f} s")
    return not failures, lines + summarize_main_process(extra)


def main_process_failures(extra: dict) -> List[str]:
    """A raised main-process check, a JIT transfer or a per-layer backup not byte-exact, a
    per-layer pipeline breach or its negative control not caught."""
    failures = [
        f"{name} raised: {report['error']}"
        for name, report in extra.items()
        if "error" in report
    ]
    jit = extra.get("hicache_jit", {})
    if jit.get("ran") and not jit.get("ok"):
        failures.append(f"hicache JIT transfer not byte-exact: {jit}")
    per_layer = extra.get("per_layer_backup", {})
    if per_layer.get("ran") and not per_layer.get("ok"):
        failures.append(f"per-layer HiCache backup differs from SGLang's all-layer backup: {per_layer}")
    pipeline = extra.get("per_layer_pipeline", {})
    if pipeline.get("ran") and not pipeline.get("ok"):
        failures.extend(
            f"per-layer pipeline {name}: {problem}"
            for name, entry in pipeline.items()
            if isinstance(entry, dict) and name != "negative_control"
            for problem in entry["problems"]
        )
        control = pipeline.get("negative_control")
        if control is not None and not control["detected"]:
            failures.append(
                "per-layer pipeline negative control: a write stream that does not wait for "
                f"the layer's stores went undetected ({control['problems'] or 'no breach'})"
            )
    return failures


def summarize_main_process(extra: dict) -> List[str]:
    """The figure lines of the checks outside the twin ranks (bandwidth, JIT, per-layer
    backup, per-layer pipeline)."""
    lines = [f"{name} raised: {report['error']}" for name, report in extra.items() if "error" in report]
    bw, jit, per_layer, pipeline = (
        {} if "error" in extra.get(name, {}) else extra.get(name, {})
        for name in ("bandwidth", "hicache_jit", "per_layer_backup", "per_layer_pipeline")
    )
    if bw:
        lines.append(
            f"owned shard per layer ({bw['layer_shard_bytes'] / 1e6:.1f} MB, prefix {bw['prefix_tokens']}, "
            f"cp {bw['cp']}): D2H {bw['d2h_gbps']:.1f} GB/s ({bw['d2h_of_peak']:.0%} of pinned peak "
            f"{bw['peak_d2h_gbps']:.1f}), H2D {bw['h2d_gbps']:.1f} GB/s ({bw['h2d_of_peak']:.0%} of "
            f"{bw['peak_h2d_gbps']:.1f})"
        )
    if jit:
        lines.append(f"hicache JIT MLA transfer: {jit}")
    if per_layer:
        peak = bw["peak_d2h_gbps"] if bw else None
        figures = ", ".join(
            f"{name} raised {r['error']}" if "error" in r else
            f"{name} {r['layer_shard_gbps']:.1f} GB/s" + (f" ({r['layer_shard_gbps'] / peak:.0%} of pinned peak)" if peak else "")
            for name, r in per_layer.items()
            if isinstance(r, dict)
        )  # fmt: skip
        lines.append(f"per-layer backup (one layer's owned shard, KV + index K, byte-exact={per_layer['ok']}): {figures}")
    if pipeline:
        figures = "; ".join(
            f"{name} {'ok' if not entry['problems'] else 'FAILED'}"
            + ("" if None in entry["overlap_ms"] or not entry["overlap_ms"] else
               f", layer 0 on host {min(entry['overlap_ms']):.2f}-{max(entry['overlap_ms']):.2f} ms before the last layer's stores")
            for name, entry in pipeline.items()
            if isinstance(entry, dict) and name != "negative_control"
        )  # fmt: skip
        control = pipeline.get("negative_control")
        if control is not None:
            figures += (
                f"; negative control (no wait for a layer's stores): "
                f"{'caught, ' + str(control['stale_loads']) + ' stale node loads' if control['detected'] else 'NOT caught'}"
            )
        lines.append(f"per-layer pipeline (CP stack, write/load streams, acks, load-back byte-exact): {figures}")
    return lines


# ----------------------------------------------------------------- process launch
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, world: int, port: int, fn: Callable, options: dict, queue) -> None:
    if options["device"] == "cpu":  # the CPU runtime must be in place before SGLang loads
        from sglang_cp_hicache.testing import install

        install()
    import torch.distributed as dist

    from sglang_cp_hicache.testing.dist import init_rank_groups

    try:
        # The CP group and each rank's own attention-TP group (the cache stack takes both).
        ctx = init_rank_groups(rank, world, port, options["timeout_s"])
        queue.put((rank, True, fn(ctx, options)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(world: int, fn: Callable, options: dict) -> List[dict]:
    """Run ``fn(ctx, options)`` on ``world`` spawned processes; raise with the first traceback."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, port, fn, options, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=options["timeout_s"])
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world)]


def parse_args(argv: Optional[Sequence[str]]) -> tuple[CheckOptions, bool]:
    parser = argparse.ArgumentParser(description="Offline one-GPU check of CP shared KV")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    return CheckOptions(args.device, args.cp, args.timeout), args.dry_run


def main(argv: Optional[Sequence[str]] = None, launch: Callable = spawn_ranks) -> int:
    line, argv = _line_of(argv)
    if line == LINE_0_5_23:
        return main_0_5_23(argv)
    options, dry_run = parse_args(argv)
    if dry_run:
        print(describe(options))
        return 0
    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("FAIL no CUDA device visible (use --device cpu for the CPU twin)")
            return 1
    start = time.perf_counter()
    rank_error = None
    try:
        per_rank = launch(options.cp_size, check_rank, asdict(options))
    except Exception as exc:  # a rank crashed: the main-process checks still run (one GPU call)
        per_rank, rank_error = None, exc
        print(str(exc), file=sys.stderr)
    extra = main_process_checks(options)
    extra["per_layer_pipeline"] = per_layer_pipeline(options, launch)
    if rank_error is not None:
        lines = [f"FAIL {type(rank_error).__name__}: {str(rank_error).strip().splitlines()[-1]}"]
        lines += summarize_main_process(extra)
        ok = False
    else:
        ok, lines = summarize(per_rank, options, time.perf_counter() - start, extra)
    for line in lines:
        print(line)
    write_json({"ok": ok, "summary": lines, "versions": versions(), "ranks": per_rank, **extra})
    return 0 if ok else 1


def main_process_checks(options: CheckOptions) -> dict:
    """Each check's report; a check that raises is reported as ``{"ran": False, "ok":
    False, "error": ...}`` and the others still run, so one device call reports them all."""
    if options.device == "cpu":  # the per-layer backup check loads SGLang's host pools
        from sglang_cp_hicache.testing import install

        install()
    import torch

    device = torch.device("cuda:0" if options.device == "cuda" else "cpu")
    shard = ShardGeometry() if options.device == "cuda" else ShardGeometry(prefix_tokens=16384)
    checks = {
        "bandwidth": lambda: shard_bandwidth(device, shard),
        "hicache_jit": lambda: hicache_jit_transfer(device),
        "per_layer_backup": lambda: per_layer_backup(device, shard),
    }
    reports = {}
    for name, check in checks.items():
        try:
            reports[name] = check()
        except Exception as exc:
            logging.exception("main-process check %s raised", name)
            reports[name] = {"ran": False, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return reports


def versions(extra: Sequence[str] = ()) -> dict:
    """The installed versions of torch, the GPU and the bundle's main packages (+ ``extra``)."""
    import importlib.metadata as md

    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    for name in ("sglang", "sglang-kernel", "triton", "transformers", "apache-tvm-ffi", *extra):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def write_json(report: dict) -> Optional[str]:
    path = os.environ.get("GPU_CHECK_JSON")
    if not path and os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "device_check.json")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return path


# ----------------------------------------------------------------- the 0.5.23 line
# ----------------------------------------------------------------- the 0.5.23 line
LINE_0_5_12 = "0.5.12.post1"
LINE_0_5_23 = "0.5.23"
#: What the Hopper admission admits (``testing/v0_5_23/read_path/formats.py`` ``KV_FORMATS``).
FORMATS_0_5_23 = ("flashmla_sparse/bfloat16", "flashmla_kv/fp8_e4m3")
_MODULE_NAME = "gpu_device_check"  # how the rank processes import this file
#: The top-k paths the CUDA self-test runs (``gpu_selftest.CUDA_TOPK_PATHS``; named here so a
#: dry run needs no torch).
TOPK_PATHS_0_5_23 = ("jit-v2", "sgl-kernel")
#: The packages the 0.5.23 CUDA path loads first: (distribution, module).
KERNEL_PACKAGES_0_5_23 = (("sglang-kernel", "sgl_kernel"), ("sgl-flash-mla", "flash_mla"))
#: The per-layer round trip's host layouts (``layer_round_trip.LAYOUTS``).
ROUND_TRIP_LAYOUTS_0_5_23 = ("layer_first", "page_first")
#: The round trip's planted faults per device (``layer_round_trip.plants_for``), run on
#: every layout.
ROUND_TRIP_PLANTS_0_5_23 = {"cpu": ("layer_copy_dropped",), "cuda": ("layer_copy_dropped", "missing_wait")}
#: Planted faults per device, each run inside the check; every one must be caught or the
#: check fails.
PLANTED_0_5_23 = {
    device: (
        "self-test", "twin", "twin-mtp",
        *(f"round-trip/{layout}/{plant}" for layout in ROUND_TRIP_LAYOUTS_0_5_23 for plant in plants),
        "kvcacheio", "bandwidth-sanity",
    )
    for device, plants in ROUND_TRIP_PLANTS_0_5_23.items()
}  # fmt: skip
#: On the GPU, the owned-shard D2H and H2D must reach this share of the pinned peak.
BANDWIDTH_TARGET_OF_PEAK = 0.8
#: A rate above this share of the pinned peak did not move the bytes it claims.
BANDWIDTH_SANITY_OF_PEAK = 1.25


def _line_of(argv: Optional[Sequence[str]]) -> tuple[str, List[str]]:
    """``--sglang X`` taken off ``argv`` (default: the 0.5.12.post1 line, unchanged)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--sglang", choices=(LINE_0_5_12, LINE_0_5_23), default=LINE_0_5_12)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    return args.sglang, rest


def describe_0_5_23(options: CheckOptions) -> str:
    cuda = options.device == "cuda"
    head = (
        f"plan (sglang 0.5.23): load sglang-kernel and sgl-flash-mla; {options.cp_size} processes on the one "
        "GPU, gloo CP group with host-staged gathers (the check's shim for NCCL), SGLang's CUDA kernels"
        if cuda
        else f"plan (sglang 0.5.23): {options.cp_size} processes, gloo CP group, device={options.device}, "
        "torch stand-in kernels"
    )
    selftest = (
        f"at GLM-5's KV geometry x top-k path {list(TOPK_PATHS_0_5_23)}" if cuda else "at the CPU twin's geometry"
    )
    target = f">= {BANDWIDTH_TARGET_OF_PEAK:.0%} of pinned peak" if cuda else "figures only"
    return (
        f"{head}; per admitted format {list(FORMATS_0_5_23)}: the startup self-test through its hook "
        f"(gather, indexer, translation, attention) {selftest}, and the read-path twins sharded vs "
        "replicated (target extend and MTP draft extend: records bit for bit, owned rows, block table); "
        f"the per-layer backup round trip on the real sharded stack per host layout {list(ROUND_TRIP_LAYOUTS_0_5_23)}"
        + (
            " (page_first where upstream's JIT HiCache kernel builds here, probed first in the main process: "
            "nvcc, ninja, c++ and libcudart under CUDA_HOME, or a cached build; else reported NOT RUN with the "
            "reason, its planted faults too)"
            if cuda
            else ""
        )
        + ": reservations before the "
        "forward, per-layer stores then backups on the D2H stream, one ack per forward after the last layer on "
        "every rank (a zero-owned one too), device wipe, load-back byte-exact"
        + (", layer 0's copy overlapping the forward from CUDA events" if cuda else "")
        + "; then in the main process sglang-kernel's per-layer / all-layer MLA transfers as the DSA host "
        f"pools call them (layer_first, page_first) byte-exact, and owned-shard D2H/H2D GB/s ({target}); "
        f"planted faults that must be caught: {list(PLANTED_0_5_23[options.device])}"
    )


def _timed_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    import torch.distributed as dist

    dist.barrier()  # every rank starts together: its seconds are its own work
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def _twin_entry(compare: Callable[[], Any]) -> dict:
    try:
        comparison, seconds = _timed_call(compare)
    except Exception as exc:  # a kernel that would not run is a failure too
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    return {
        "identical": comparison.identical,
        "table_translated": comparison.table_translated,
        "pool_problems": list(comparison.pool_problems),
        "block_table_problems": list(getattr(comparison, "block_table_problems", ())),
        "seconds": seconds,
    }


def twin_problems(twin: dict) -> List[str]:
    """What a twin entry breaks (none: sharded == replicated)."""
    if "error" in twin:
        return [f"raised {twin['error']}"]
    problems = [] if twin["identical"] else ["read_path: sharded extend != replicated"]
    if not twin["table_translated"]:
        problems.append("translation: the kernel read the logical table")
    problems += [f"pool: {p}" for p in twin["pool_problems"]]
    problems += [f"block_table: {p}" for p in twin["block_table_problems"]]
    return problems


def _planted_selftest_caught(entry: dict) -> bool:
    """Caught by one of the self-test's own stages (a crash proves nothing)."""
    return not entry["ok"] and entry.get("stage") in ("gather", "indexer", "translation", "attention")


def _rank_selftests(group: Any, device: Any, plant: Callable = contextlib.nullcontext) -> List[dict]:
    """The self-test per format (and, on CUDA, per top-k path), under ``plant``."""
    from sglang_cp_hicache.testing.v0_5_23 import device_twins
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import run_selftests, selftest_entry
    from sglang_cp_hicache.testing.v0_5_23.selftest_kernels import selftest_runner

    with plant():
        if device.type == "cuda":
            return run_selftests(group)
        entries = []
        for kv_format in device_twins.twin_formats(device):
            with device_twins.twin_session(group, kv_format, device) as rank:
                entry = selftest_entry(selftest_runner(rank), group.cpu_group)
            entries.append({"format": kv_format.name, "topk": "torch", "selftest": entry})
        return entries


def _rank_twins(group: Any, device: Any) -> tuple[List[dict], dict]:
    """Per format the target and MTP draft twins; then, planted, both twins of the first."""
    from sglang_cp_hicache.testing.v0_5_23 import device_twins

    twins, planted = [], {}
    for i, kv_format in enumerate(device_twins.twin_formats(device)):
        with device_twins.twin_session(group, kv_format, device) as rank:
            twins.append(
                {
                    "format": kv_format.name,
                    "target": _twin_entry(rank.compare_sharded_to_replicated),
                    "draft": _twin_entry(rank.draft().compare_sharded_to_replicated),
                }
            )
            if i == 0:
                with device_twins.misread_prefix_page():
                    planted["twin"] = _twin_entry(rank.compare_sharded_to_replicated)
                    planted["twin-mtp"] = _twin_entry(rank.draft().compare_sharded_to_replicated)
    return twins, planted


def _rank_round_trips(ctx: Any, group: Any, not_run: Mapping[str, str]) -> tuple[dict, dict]:
    """The round trip per layout, then each planted fault of this device on each layout;
    a layout in ``not_run`` (the main process's probe said why) and its plants are skipped.
    An error is recorded, not raised. On CUDA the sharded pools gather over gloo,
    host-staged (the check's shim for NCCL)."""
    from sglang_cp_hicache.testing.v0_5_23 import layer_round_trip as rt
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import staged_gathers

    device = group.device.type
    shim = staged_gathers if device == "cuda" else lambda _: contextlib.nullcontext()

    def run(layout: str, plant: Any = contextlib.nullcontext()) -> dict:
        try:
            with shim(group), plant:
                return rt.round_trip(
                    ctx, device, layout, stall_cycles=STALL_CYCLES if device == "cuda" else 0,
                    keep_stacks=LIVE_HOST_POOLS,
                )  # fmt: skip
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}

    runs = [layout for layout in rt.LAYOUTS if layout not in not_run]
    layouts = {layout: run(layout) for layout in runs}
    planted = {f"round-trip/{layout}/{name}": run(layout, rt.planted(name)) for layout in runs for name in rt.plants_for(device)}
    return layouts, planted


def check_rank_0_5_23(ctx: Any, options: dict) -> dict:
    """One rank: self-tests, twins (target + MTP draft), the per-layer round trip, and the
    planted faults of each; every part reports its own error and the others still run.
    ``options["round_trip_not_run"]``: round-trip layouts not to run, with why (absent: all)."""
    import torch

    from sglang_cp_hicache.testing.v0_5_23 import device_twins
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import shard_group_on

    names = tuple(f.name for f in device_twins.twin_formats(torch.device("cpu")))
    if names != FORMATS_0_5_23:
        raise RuntimeError(f"admitted formats changed: {names}, this check knows {FORMATS_0_5_23}")
    cuda = options["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    device = torch.device("cuda:0" if cuda else "cpu")
    group = shard_group_on(ctx, device)
    report: dict = {"planted": {}}
    report["selftests"] = _rank_selftests(group, device)
    planted_selftest = _rank_selftests(group, device, device_twins.misread_prefix_page)
    report["planted"]["self-test"] = {
        "caught": all(_planted_selftest_caught(e["selftest"]) for e in planted_selftest),
        "entries": planted_selftest,
    }
    report["twins"], planted_twins = _rank_twins(group, device)
    for name, twin in planted_twins.items():
        report["planted"][name] = dict(twin, caught="error" not in twin and bool(twin_problems(twin)))
    report["round_trip"], planted_trips = _rank_round_trips(ctx, group, options.get("round_trip_not_run", {}))
    report["planted"].update(planted_trips)
    return report


# ----------------------------------------------------------------- main-process checks (0.5.23)
class _MisplacingOps:
    """sglang-kernel's ``kvcacheio`` (or the CPU reference) whose per-layer loads land one
    row off: the kvcacheio check's planted fault."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops

    def _shifted(self, name: str) -> Callable:
        def call(**kwargs: Any) -> Any:
            kwargs["dst_indices"] = kwargs["dst_indices"].roll(1)
            return getattr(self._ops, name)(**kwargs)

        return call

    def __getattr__(self, name: str) -> Any:
        if name in ("transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf"):
            return self._shifted(name)
        return getattr(self._ops, name)


@contextlib.contextmanager
def _kvcacheio_misplaced() -> Iterator[None]:
    from sglang_cp_hicache.testing.v0_5_23 import gpu_selftest

    real = gpu_selftest.kvcacheio_ops
    gpu_selftest.kvcacheio_ops = lambda device: _MisplacingOps(real(device))
    try:
        yield
    finally:
        gpu_selftest.kvcacheio_ops = real


def owned_shard_bandwidth(device: Any, shard: ShardGeometry, repeats: int = 5, skip_half: bool = False) -> dict:
    """One layer's owned shard gathered D2H and scattered H2D (pinned host memory on CUDA)
    against pinned contiguous copies of the same bytes (the peak), in GB/s, and whether
    the bytes arrived: host == the owned device pages after D2H, and the owned pages of a
    cleared pool == host after H2D. ``skip_half``: the planted fault, a D2H and an H2D that
    move only half the pages (a rate that did not move its bytes)."""
    import torch

    pages = shard.owned_pages
    pin = device.type == "cuda"
    gen = torch.Generator().manual_seed(38)
    pool = torch.randint(0, 255, (3 * pages, shard.page_bytes), dtype=torch.uint8, generator=gen).to(device)
    owned = torch.randperm(3 * pages, generator=gen)[:pages].to(device)
    moved = owned[: pages // 2] if skip_half else owned
    # Zeroed: a D2H that skips pages must leave bytes that differ (a reused block may hold them).
    host = torch.zeros(pages, shard.page_bytes, dtype=torch.uint8, pin_memory=pin)
    staging = torch.empty(pages, shard.page_bytes, dtype=torch.uint8, device=device)
    target = torch.zeros_like(pool)

    def d2h() -> None:
        torch.index_select(pool, 0, moved, out=staging[: len(moved)])
        host[: len(moved)].copy_(staging[: len(moved)], non_blocking=pin)

    def h2d() -> None:
        staging[: len(moved)].copy_(host[: len(moved)], non_blocking=pin)
        target.index_copy_(0, moved, staging[: len(moved)])

    nbytes = pages * shard.page_bytes
    result = {"layer_shard_bytes": nbytes, "owned_pages": pages, "prefix_tokens": shard.prefix_tokens, "cp": shard.cp_size, "pinned": pin}
    for name, fn in (
        ("d2h", d2h), ("h2d", h2d),
        ("peak_d2h", lambda: host.copy_(staging, non_blocking=pin)),
        ("peak_h2d", lambda: staging.copy_(host, non_blocking=pin)),
    ):  # fmt: skip
        if name == "h2d":  # what the H2D must bring back, whatever the D2H left
            host.copy_(pool.index_select(0, owned).cpu())
        result[f"{name}_gbps"] = nbytes / _timed(fn, device, repeats) / 1e9
        if name == "d2h":
            result["d2h_exact"] = bool(torch.equal(host, pool.index_select(0, owned).cpu()))
        if name == "h2d":
            result["h2d_exact"] = bool(torch.equal(target.index_select(0, owned).cpu(), pool.index_select(0, owned).cpu()))
    result["d2h_of_peak"] = result["d2h_gbps"] / result["peak_d2h_gbps"]
    result["h2d_of_peak"] = result["h2d_gbps"] / result["peak_h2d_gbps"]
    return result


def bandwidth_problems(bw: dict, device: str) -> List[str]:
    """The bytes arrived; on the GPU also no rate beyond :data:`BANDWIDTH_SANITY_OF_PEAK`
    of its peak and both at least :data:`BANDWIDTH_TARGET_OF_PEAK` of it (on a shared CPU
    the rates are noise: figures only)."""
    if "error" in bw:
        return [f"raised {bw['error']}"]
    problems = [f"{d} bytes did not arrive" for d in ("d2h", "h2d") if not bw[f"{d}_exact"]]
    for d in ("d2h", "h2d") if device == "cuda" else ():
        share = bw[f"{d}_of_peak"]
        if share > BANDWIDTH_SANITY_OF_PEAK:
            problems.append(f"{d} {share:.0%} of pinned peak: more than a copy of those bytes can reach")
        elif device == "cuda" and share < BANDWIDTH_TARGET_OF_PEAK:
            problems.append(f"{d} {share:.0%} of pinned peak, below the {BANDWIDTH_TARGET_OF_PEAK:.0%} target")
    return problems


def main_process_0_5_23(device: Any) -> dict:
    """kvcacheio and bandwidth, each with its planted fault; an error is recorded."""
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import kvcacheio_check

    shard = ShardGeometry() if device.type == "cuda" else ShardGeometry(prefix_tokens=16384)

    def guarded(fn: Callable[[], dict], failed: Callable[[str], dict]) -> dict:
        try:
            return fn()
        except Exception as exc:
            logging.exception("main-process check raised")
            return failed(f"{type(exc).__name__}: {exc}")

    def kvcacheio_failed(error: str) -> dict:
        return {"ok": False, "cases": [], "problems": [error]}

    def bandwidth_failed(error: str) -> dict:
        return {"error": error}

    out = {"kvcacheio": guarded(lambda: kvcacheio_check(device), kvcacheio_failed)}
    with _kvcacheio_misplaced():
        planted_io = guarded(lambda: kvcacheio_check(device), kvcacheio_failed)
    out["bandwidth"] = guarded(lambda: owned_shard_bandwidth(device, shard), bandwidth_failed)
    planted_bw = guarded(lambda: owned_shard_bandwidth(device, shard, skip_half=True), bandwidth_failed)
    out["planted"] = {
        # Caught by the byte check of a load (a transfer that raised proves nothing).
        "kvcacheio": dict(planted_io, caught=any("per-layer load" in p for p in planted_io["problems"])),
        "bandwidth-sanity": dict(planted_bw, caught="error" not in planted_bw and bool(bandwidth_problems(planted_bw, device.type))),
    }  # fmt: skip
    return out


# ----------------------------------------------------------------- verdict (0.5.23)
def _round_trip_verdicts(per_rank: Sequence[dict], key: str) -> dict:
    """Per layout (``key="round_trip"``) or planted fault (``key="planted"``), the ranks'
    round trips judged together: errors, the contract's breaches, stale loads, overlap."""
    from sglang_cp_hicache.testing.v0_5_23.layer_round_trip import round_trip_problems, stale_loads

    names = [n for n in per_rank[0][key] if key == "round_trip" or n.startswith("round-trip/")]
    verdicts = {}
    for name in names:
        entries = [report[key][name] for report in per_rank]
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if "loaded" not in e]
        verdicts[name] = {
            "problems": errors or round_trip_problems(entries),
            "raised": bool(errors),
            "stale_loads": 0 if errors else stale_loads(entries),
            "overlap_ms": [e.get("overlap_ms") for e in entries],
        }
    return verdicts


def round_trip_not_run(not_run: Mapping[str, str], device: str) -> dict:
    """Each round trip (``round-trip/<layout>``) and round-trip plant of ``device`` left
    out because its layout is in ``not_run``, with ``not run: <why>``."""
    return {
        name: f"not run: {not_run[layout]}"
        for layout in ROUND_TRIP_LAYOUTS_0_5_23 if layout in not_run
        for name in (f"round-trip/{layout}", *(f"round-trip/{layout}/{p}" for p in ROUND_TRIP_PLANTS_0_5_23[device]))
    }  # fmt: skip


def planted_verdicts(per_rank: Sequence[dict], main: dict, device: str, not_run: Mapping[str, str] = {}) -> dict:
    """Each planted fault of ``device`` that ran: caught or not (a round-trip plant only by
    stale bytes in the load-back on every rank's report, never by a crash). The plants of a
    round-trip layout in ``not_run`` are left out (:func:`round_trip_not_run` names them)."""
    caught = {}
    trips = _round_trip_verdicts(per_rank, "planted") if per_rank else {}
    skipped = round_trip_not_run(not_run, device)
    for name in PLANTED_0_5_23[device]:
        if name in skipped:
            continue
        if name.startswith("round-trip/"):
            v = trips.get(name)
            caught[name] = bool(v) and not v["raised"] and v["stale_loads"] > 0
        elif name in ("kvcacheio", "bandwidth-sanity"):
            caught[name] = bool(main.get("planted", {}).get(name, {}).get("caught"))
        else:
            caught[name] = bool(per_rank) and all(r["planted"][name]["caught"] for r in per_rank)
    return caught


def summarize_0_5_23(
    per_rank: Optional[Sequence[dict]], rank_error: Optional[BaseException], main: dict,
    options: CheckOptions, wall_s: float, not_run: Mapping[str, str] = {},
) -> tuple[bool, List[str]]:  # fmt: skip
    """One PASS/FAIL line naming the first failure (rank, format, check, stage), then the
    figures: slowest self-test and twin per format, the round trip, bandwidth, planted.
    A round-trip layout in ``not_run`` (why, from the main process's probe) decides
    nothing; the line ends naming it and its plants NOT RUN with the reason. Any other
    layout the ranks did not report is a failure."""
    failures = []
    if rank_error is not None:
        failures.append(f"stage rank: {type(rank_error).__name__}: {str(rank_error).strip().splitlines()[-1]}")
    for rank, report in enumerate(per_rank or ()):
        for e in report["selftests"]:
            if not e["selftest"]["ok"]:
                t = e["selftest"]
                failures.append(f"rank {rank} {e['format']} top-k {e['topk']} self-test stage {t['stage']}: {t['error']}")
        for twin in report["twins"]:
            for which, label in (("target", "twin"), ("draft", "twin-mtp")):
                failures += [f"rank {rank} {twin['format']} {label} stage {p}" for p in twin_problems(twin[which])]
    trips = _round_trip_verdicts(per_rank, "round_trip") if per_rank else {}
    for layout, verdict in trips.items():
        failures += [f"round trip {layout}: {p}" for p in verdict["problems"]]
    if per_rank:
        missing = [l for l in ROUND_TRIP_LAYOUTS_0_5_23 if l not in trips and l not in not_run]
        failures += [f"round trip {layout}: not reported by the ranks" for layout in missing]
    failures += [f"stage kvcacheio: {p}" for p in main.get("kvcacheio", {}).get("problems", ())]
    failures += [f"stage bandwidth: {p}" for p in bandwidth_problems(main.get("bandwidth", {"error": "not run"}), options.device)]
    caught = planted_verdicts(per_rank, main, options.device, not_run)
    failures += [f"planted fault {name} not caught" for name, ok in caught.items() if not ok]
    skipped = round_trip_not_run(not_run, options.device)
    head = f"cp={options.cp_size} device={options.device} sglang=0.5.23"
    if failures:
        lines = [f"FAIL 0.5.23 sharded KV != replicated or the check cannot fail ({head}): {failures[0]} (+{len(failures) - 1} more)"]
    else:
        paths = sorted({e["topk"] for e in per_rank[0]["selftests"]})
        lines = [
            f"PASS 0.5.23 sharded KV == replicated ({head}, {len(FORMATS_0_5_23)} formats x {options.cp_size} ranks: "
            f"self-test x {len(paths)} top-k paths, twins target + MTP draft; per-layer round trip {list(trips)}"
            f"; kvcacheio {len(main['kvcacheio']['cases'])} cases byte-exact; {len(caught)} planted faults caught)"
        ]
    for layout, why in not_run.items():  # loud on PASS and on FAIL: a part of the check did not run
        plants = [n for n in skipped if n.startswith(f"round-trip/{layout}/")]
        lines[0] += f"; round trip {layout} NOT RUN: {why}; its planted faults {plants} not run either"
    if per_rank:
        timings = []
        for i, e in enumerate(per_rank[0]["selftests"]):
            seconds = max(r["selftests"][i]["selftest"].get("seconds", 0.0) for r in per_rank)
            timings.append(f"{e['format']} top-k {e['topk']} {seconds:.2f} s")
        lines.append(f"self-test (slowest rank): {'; '.join(timings)}")
        twins = []
        for i, t in enumerate(per_rank[0]["twins"]):
            target = max(r["twins"][i]["target"].get("seconds", 0.0) for r in per_rank)
            draft = max(r["twins"][i]["draft"].get("seconds", 0.0) for r in per_rank)
            twins.append(f"{t['format']} target {target:.2f} s, MTP draft {draft:.2f} s")
        lines.append(f"twins (slowest rank): {'; '.join(twins)}")
        for layout, v in trips.items():
            overlap = [o for o in v["overlap_ms"] if o is not None]
            lines.append(
                f"round trip {layout}: {'ok' if not v['problems'] else 'FAILED'}"
                + (f", layer 0 on host {min(overlap):.2f}-{max(overlap):.2f} ms before the last layer's stores" if overlap else "")
            )
        lines += [f"round trip {layout}: NOT RUN ({why})" for layout, why in not_run.items()]
    bw = main.get("bandwidth", {})
    if "d2h_gbps" in bw:
        lines.append(
            f"owned shard per layer ({bw['layer_shard_bytes'] / 1e6:.1f} MB, prefix {bw['prefix_tokens']}, cp {bw['cp']}, "
            f"pinned={bw['pinned']}): D2H {bw['d2h_gbps']:.1f} GB/s ({bw['d2h_of_peak']:.0%} of peak {bw['peak_d2h_gbps']:.1f}), "
            f"H2D {bw['h2d_gbps']:.1f} GB/s ({bw['h2d_of_peak']:.0%} of {bw['peak_h2d_gbps']:.1f})"
            + ("" if options.device == "cuda" else "; CPU: figures only")
        )
    lines.append(
        "planted faults: "
        + ", ".join([f"{n} {'caught' if ok else 'NOT caught'}" for n, ok in caught.items()] + [f"{n} NOT RUN" for n in skipped if n in PLANTED_0_5_23[options.device]])
    )
    lines.append(f"total {wall_s:.1f} s")
    return not failures, lines


# ----------------------------------------------------------------- the 0.5.23 line (CUDA)
def load_kernels_0_5_23() -> dict:
    """Import the kernel packages first, each on its own: a build that does not match the
    host's torch fails here naming its package and the loader's last line (an undefined
    torch symbol), before any rank starts. FlashMLA's SM90 kernels are its legacy half."""
    import importlib

    loaded = {}
    for package, module in KERNEL_PACKAGES_0_5_23:
        try:
            loaded[package] = importlib.import_module(module)
        except Exception as exc:  # ImportError, or OSError from torch.ops.load_library
            return {"ok": False, "error": f"{package}: {_loader_reason(exc)}"}
    flash_mla = loaded["sgl-flash-mla"]
    if not flash_mla.has_legacy():
        return {"ok": False, "error": f"sgl-flash-mla: its SM90 (legacy) kernels did not load: {flash_mla._loader._LEGACY_UNAVAILABLE}"}
    return {"ok": True, "modules": {p: getattr(m, "__file__", None) for p, m in loaded.items()}}


def _loader_reason(exc: BaseException) -> str:
    """``Type: message`` of a loader error, from the line that says why: sgl_kernel lists
    its attempts as ``- Type: ...`` lines, the first being the architecture's own library
    (an undefined symbol, a missing CUDA library); other loaders raise one line."""
    lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()] or [""]
    attempts = [l[2:] for l in lines if l.startswith("- ")]
    return attempts[0] if attempts else f"{type(exc).__name__}: {lines[-1]}"


def probe_page_first_jit_0_5_23() -> dict:
    """CUDA, in the main process before any rank: does upstream's JIT one-layer HiCache
    kernel, which the product's page_first per-layer backup needs, build (or load from its
    cache) on this host (``layer_round_trip.probe_page_first_jit``)? A probe that raised
    is recorded as ``error`` and answers available: the round trip then runs and its own
    error decides (only a definite no leaves page_first out)."""
    from sglang_cp_hicache.testing.v0_5_23.layer_round_trip import probe_page_first_jit

    try:
        return probe_page_first_jit()
    except Exception as exc:
        logging.exception("the page_first JIT probe raised")
        return {"available": True, "reason": None, "error": f"{type(exc).__name__}: {exc}"}


def _importable(fn: Callable) -> Callable:
    """``run_ranks`` re-imports ``fn`` in each rank by module name and file; run as a script,
    this file is ``__main__`` there, so it is named :data:`_MODULE_NAME` instead."""
    if fn.__module__ == "__main__":
        sys.modules.setdefault(_MODULE_NAME, sys.modules["__main__"])
        fn.__module__ = _MODULE_NAME
    return fn




def main_0_5_23(argv: Sequence[str], launch: Optional[Callable] = None) -> int:
    """``launch(world, fn, options)`` runs ``fn`` on every rank (default: on CPU the CPU
    runtime's gloo ranks, ``testing.dist.run_ranks``; on CUDA :func:`spawn_ranks`). The
    main-process checks still run when a rank crashed (a device call is one shot)."""
    options, dry_run = parse_args(argv)
    if dry_run:
        print(describe_0_5_23(options))
        return 0
    import torch

    report: dict = {"line": LINE_0_5_23}
    not_run: dict = {}  # round-trip layout -> why it does not run (CUDA: the JIT probe's no)
    if options.device == "cuda":
        if not torch.cuda.is_available():
            print("FAIL no CUDA device visible (use --cpu for the CPU checks)")
            return 1
        load = load_kernels_0_5_23()
        report.update(load=load, versions=versions(("sgl-flash-mla", "torchvision")))
        if not load["ok"]:
            lines = [f"FAIL 0.5.23 on the GPU (device=cuda sglang=0.5.23): stage load: {load['error']}"]
            print(lines[0])
            write_json({"ok": False, "summary": lines, **report})
            return 1
        launch = launch or spawn_ranks
        report["page_first_jit"] = probe_page_first_jit_0_5_23()
        if not report["page_first_jit"]["available"]:
            not_run["page_first"] = f"JIT HiCache kernel unavailable on this host ({report['page_first_jit']['reason']})"
            logging.warning("round trip page_first NOT RUN: %s", not_run["page_first"])
    else:
        from sglang_cp_hicache.testing import install

        install()  # the CPU runtime before SGLang loads, here and in every rank
        report["versions"] = versions()
        if launch is None:
            from sglang_cp_hicache.testing.dist import run_ranks

            def launch(world: int, fn: Callable, plain: dict) -> List[dict]:
                return run_ranks(world, _importable(fn), plain, timeout_s=options.timeout_s)

    start = time.perf_counter()
    per_rank, rank_error = None, None
    try:
        per_rank = launch(options.cp_size, check_rank_0_5_23, dict(asdict(options), round_trip_not_run=not_run))
    except Exception as exc:
        rank_error = exc
        print(str(exc), file=sys.stderr)
    main = main_process_0_5_23(torch.device("cuda:0" if options.device == "cuda" else "cpu"))
    ok, lines = summarize_0_5_23(per_rank, rank_error, main, options, time.perf_counter() - start, not_run)
    for line in lines:
        print(line)
    report["not_run"] = round_trip_not_run(not_run, options.device)
    write_json({"ok": ok, "summary": lines, **report, "ranks": per_rank, **main})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
