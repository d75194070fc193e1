"""The 0.5.23 line's rank entry points (run in each simulated scheduler process via
``testing.dist.run_ranks``) and its :class:`~sglang_cp_hicache.sim.lines.LineSim`.

Columns on this line, all on the real 0.5.23 cache stack (``testing.v0_5_23.stack``):

* ``native``: upstream's KV sharding alone (``--enable-kv-cache-sharding``:
  ``PageInterleaveDSATokenToKVPool``, ``PageInterleavePoolAllocator``, ``UnifiedRadixCache``
  with ``PageInterleaveHostPool``), no plugin hooks;
* ``plugin``: the same stack in a process where the plugin's 0.5.23 hooks are applied the
  way ``load_plugins`` applies them (refused if one is missing), and the plugin's flag on
  the stack's record (``StackConfig.cp_shared_kv``, marked before the record is resolved).
  Of the plugin's scheduler-path deltas this column runs lane-aware device eviction and
  per-layer D2H backup (``SimConfig.per_layer_backup``, on by default: the flag attaches
  it at ``init_hicache`` on both host layouts, or refuses the start-up naming what the
  host pools lack, ``l2_transfer.per_layer_problem``; ``--all-layer-backup``: upstream's
  all-layer path after the forward);
* ``upstream``: the unsharded stack on one rank with the same per-rank memory.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from sglang_cp_hicache.sim.collectives import CollectiveCounter, all_ranks_equal
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.engine import max_context_len, run_with_progress, setup_rank_process
from sglang_cp_hicache.sim.lines import LineSim
from sglang_cp_hicache.sim.results import RankResult
from sglang_cp_hicache.sim.v0_5_23.faults import PER_LAYER_FAULTS
from sglang_cp_hicache.sim.v0_5_23.faults import SUPPORTED as SUPPORTED_FAULTS
from sglang_cp_hicache.sim.v0_5_23.storage import BACKENDS as STORAGE_BACKENDS
from sglang_cp_hicache.sim.v0_5_23.storage import StorageRun, open_storage
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing.dist import RankContext

RELEASE = "0.5.23"
# Upstream's sharded DSA HiCache needs kernel I/O with layer_first or page_first
# (arg_groups/kv_shard_hook.py:185-193); the DSA indexer needs 64-token pages.
IO_BACKEND = "kernel"
MEM_LAYOUTS = ("layer_first", "page_first")
MEM_LAYOUT = "page_first"  # upstream's default (arg_groups/fields/memory.py)
PAGE_SIZE = 64


def _apply_plugin_hooks() -> None:
    """Patch SGLang in this rank as ``load_plugins`` patches a scheduler process (the
    plugin's ``register()`` then ``HookRegistry.apply_hooks()``); refuse to run with any
    hook or resolution step missing."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_23.hooks import missing_hooks

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not installed in the simulated rank: {missing}")


def stack_config(cfg: SimConfig, steps: List[List[Request]]):
    """One rank's ``testing.v0_5_23.rank_stack.StackConfig``: the same per-rank device pool and
    host ratio for every column. The sharded scratch's chunk region is the scheduler's
    chunk budget (``--chunked-prefill-size``) or, without chunking, a full batch."""
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

    context_len = max_context_len(steps, cfg.page_size)
    chunk = cfg.chunked_prefill_size or cfg.batch_size * context_len
    return StackConfig(
        page_size=cfg.page_size,
        layer_num=cfg.layer_num,
        device_pages_per_rank=cfg.physical_tokens // cfg.page_size,
        host_to_device_ratio=cfg.hicache_ratio,
        io_backend=cfg.io_backend or IO_BACKEND,
        mem_layout=LINE.resolved_mem_layout(cfg),
        context_len=context_len,
        chunk_tokens=-(-chunk // cfg.page_size) * cfg.page_size,
        max_num_reqs=max(8, 2 * cfg.batch_size),
        mtp_draft=cfg.draft,  # every column: upstream packs the draft in the host slots natively
    )


def _agrees_alone(decision_hash: int) -> bool:
    """The cp-1 replay's agreement check: one rank agrees with itself."""
    return True


def _drive(
    stack, cfg: SimConfig, steps, counter, agree, hooks, show: bool, desc: str, per_layer: bool = False,
    storage=None,
) -> RankResult:
    """One rank's replay; ``per_layer``: the plugin's per-layer D2H backup (else upstream's
    all-layer path)."""
    from sglang_cp_hicache.sim.v0_5_23.driver import RankDriver

    driver = RankDriver(
        stack,
        counter=counter,
        agree=agree,
        hooks=hooks,
        tree_digest_every=cfg.tree_digest_every,
        features=cfg.scheduler_features(per_layer),
        storage=storage,
    )
    return run_with_progress(lambda bar: driver.run(steps, bar), show, len(steps), desc)


def sharded_rank_main(
    ctx: RankContext, cfg: SimConfig, steps: List[List[Request]], shard_impl: str,
    storage_run: Optional[StorageRun] = None,
) -> RankResult:
    """One shard rank (the CP group is the shard group): upstream's sharded stack, with
    (``plugin``) or without (``native``) the plugin's hooks; with ``storage_run`` (plugin
    only) the run's L3 backend attached with the plugin's owner-free keys."""
    from sglang_cp_hicache.sim.v0_5_23.faults import apply_fault
    from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack

    setup_rank_process(cfg, f"{shard_impl} rank {ctx.rank}")
    if shard_impl == "plugin":
        _apply_plugin_hooks()
    config = stack_config(cfg, steps)
    if shard_impl == "plugin":
        config = dataclasses.replace(config, cp_shared_kv=True)
    stack = build_sharded_stack(ctx, config)
    storage = None
    try:
        hooks = apply_fault(cfg.fault, stack, ctx.cp_group, len(steps))
        if storage_run is not None and shard_impl == "plugin":
            storage = _attach_storage(stack, cfg, storage_run, "plugin", ctx.cp_group)
        counter = CollectiveCounter()
        counter.install()
        try:
            show = cfg.progress and ctx.rank == 0
            return _drive(
                stack, cfg, steps, counter, lambda value: all_ranks_equal(value, ctx.cp_group),
                hooks, show, f"cp={cfg.cp_size} {shard_impl}",
                per_layer=shard_impl == "plugin" and LINE.resolved_per_layer_backup(cfg),
                storage=storage,
            )  # fmt: skip
        finally:
            counter.uninstall()
    finally:
        if storage is not None:
            storage.close()
        stack.close()


def _attach_storage(stack, cfg: SimConfig, run: StorageRun, column: str, group):
    """The column's L3 tier on this rank (the ``storage_wrong_bytes`` fault: the last
    rank of the plugin column reads wrong bytes)."""
    from sglang_cp_hicache.sim.v0_5_23.storage import StorageTier

    wrong = cfg.fault == "storage_wrong_bytes" and column == "plugin"
    wrong = wrong and stack.shard_rank == stack.shard_size - 1
    return StorageTier(stack, run, column, group, wrong_reads=wrong)


def upstream_rank_main(
    ctx: RankContext, cfg: SimConfig, steps: List[List[Request]],
    storage_run: Optional[StorageRun] = None, column: str = "upstream",
) -> RankResult:
    """Upstream's unsharded cache (cp 1) with the same per-rank pools (``column``
    ``upstream_logical``: cp_size x them, the cp ranks' logical L1 + L2). No plugin hooks:
    SGLang as shipped; with ``storage_run``, upstream's own L3 backend attached."""
    from sglang_cp_hicache.sim.engine import FaultHooks
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    setup_rank_process(cfg, column)
    config = stack_config(cfg, steps)
    if column == "upstream_logical":
        pages = config.device_pages_per_rank * cfg.cp_size  # the host pool follows (ratio)
        config = dataclasses.replace(config, device_pages_per_rank=pages)
    stack = build_unsharded_stack(ctx.attn_tp_group, config)
    storage = None
    try:
        if storage_run is not None:
            storage = _attach_storage(stack, cfg, storage_run, column, None)
        counter = CollectiveCounter()
        counter.install()
        try:
            return _drive(
                stack, cfg, steps, counter, _agrees_alone, FaultHooks(), cfg.progress,
                f"{column} cp=1", storage=storage,
            )  # fmt: skip
        finally:
            counter.uninstall()
    finally:
        if storage is not None:
            storage.close()
        stack.close()


class _Line023(LineSim):
    """0.5.23's limits on top of :class:`LineSim`'s: what this line's stack cannot run."""

    def check(self, cfg: SimConfig) -> None:
        super().check(cfg)
        problems = []
        if cfg.cp_size < 2:
            problems.append("cp_size must be >= 2 (upstream's sharding needs a shard group)")
        if cfg.page_size != PAGE_SIZE:
            problems.append(f"page_size must be {PAGE_SIZE} (the DSA indexer's page)")
        if cfg.io_backend not in (None, IO_BACKEND):
            problems.append(f"io_backend must be {IO_BACKEND!r} (kv_shard_hook.py:185-193)")
        if self.resolved_mem_layout(cfg) not in MEM_LAYOUTS:
            layouts = list(MEM_LAYOUTS)
            problems.append(f"mem_layout must be one of {layouts} (kv_shard_hook.py:185-193)")
        if cfg.per_layer_backup and cfg.shard_impl == "native":
            problems.append("per_layer_backup=True: upstream's native sharding backs up all layers at once")
        if cfg.storage_backend is not None:
            problems += _storage_problems(cfg, self.resolved_mem_layout(cfg))
        if cfg.fault in PER_LAYER_FAULTS and (cfg.shard_impl != "plugin" or not self.resolved_per_layer_backup(cfg)):
            problems.append(f"fault {cfg.fault!r} needs the plugin column's per-layer backup")
        if cfg.fault == "early_layer_ack" and cfg.layer_num < 2:
            problems.append("fault 'early_layer_ack' needs layer_num >= 2")
        if problems:
            raise ValueError(f"SGLang {RELEASE} line: " + "; ".join(problems))


def _storage_problems(cfg: SimConfig, mem_layout: str) -> List[str]:
    """What this line's L3 set-up cannot run on the host layout ``mem_layout``."""
    problems = []
    if cfg.shard_impl == "native":
        problems.append(
            "storage_backend with shard_impl='native': upstream refuses --hicache-storage-backend "
            "under --enable-kv-cache-sharding (kv_shard_hook.py:176-181)"
        )
    if cfg.storage_backend == "mooncake" and mem_layout != "page_first":
        problems.append("storage_backend='mooncake' needs mem_layout='page_first' (its zero-copy I/O)")
    if cfg.pd:
        problems.append("storage_backend with pd=True: not combined in the simulator yet")
    return problems


LINE = _Line023(
    release=RELEASE,
    native_sharding=True,
    per_layer_backup=True,  # the plugin column, either layout; native and upstream: all layers
    mem_layout=MEM_LAYOUT,
    sharded_main=sharded_rank_main,
    upstream_main=upstream_rank_main,
    storage_backends=STORAGE_BACKENDS,
    open_storage=open_storage,
    faults=tuple(sorted(SUPPORTED_FAULTS)),
)
