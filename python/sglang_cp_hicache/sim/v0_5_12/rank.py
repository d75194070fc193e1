"""The 0.5.12.post1 line's rank entry points (run in each simulated scheduler process via
``testing.dist.run_ranks``) and its :class:`~sglang_cp_hicache.sim.lines.LineSim`.

Columns on this line: ``plugin`` (the plugin's CP shared KV, ``CpHiRadixCache``) and
``upstream`` (SGLang's ``HiRadixCache``, cp 1). 0.5.12.post1 has no native KV sharding.
"""

from __future__ import annotations

from typing import List

from sglang_cp_hicache.sim.collectives import CollectiveCounter, all_ranks_equal
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.engine import max_context_len, run_with_progress, setup_rank_process
from sglang_cp_hicache.sim.lines import LineSim
from sglang_cp_hicache.sim.results import RankResult
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing.dist import RankContext

# The faults this line plants: sim/v0_5_12/faults.py's (named here, since that module
# imports SGLang) and the PD owner filter's (sim/v0_5_12/pd.py).
PLANTED_FAULTS = (
    "roll_load_owners", "drop_last_rank_loads", "hot_path_barrier", "diverge_last_rank",
    "leak_tail", "shift_mirror", "drop_last_rank_draft_loads", "pd_wrong_owner",
)  # fmt: skip

# SGLang (and everything importing it) loads only inside the rank processes: they fork
# from a server that has it imported already, while the parent stays light.

RELEASE = "0.5.12.post1"
PER_LAYER_BACKUP_DEFAULT = True
IO_BACKEND = "direct"  # the line's default HiCache I/O backend
MEM_LAYOUT = "layer_first"  # upstream's default HiCache host layout (server_args.py)


def _apply_plugin_hooks() -> None:
    """Patch SGLang in this rank as ``load_plugins`` patches a scheduler process, so the
    driver's calls into SGLang's scheduler-path functions run the plugin's wrappers."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_12.hooks import missing_hooks

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not installed in the simulated rank: {missing}")


def stack_config(cfg: SimConfig, context_len: int, shared_kv: bool = True):
    """The nsa_stack.StackConfig of one rank (cp 1 and the same pool, without the draft,
    for the baseline: upstream keeps no NSA draft KV on host)."""
    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import StackConfig

    return StackConfig(
        cp_size=cfg.cp_size if shared_kv else 1,
        layer_num=cfg.layer_num,
        physical_tokens=cfg.physical_tokens,
        page_size=cfg.page_size,
        hicache_ratio=cfg.hicache_ratio,
        io_backend=cfg.io_backend or IO_BACKEND,
        mem_layout=LINE.resolved_mem_layout(cfg),
        req_pool_size=max(8, 2 * cfg.batch_size),
        max_context_len=context_len,
        draft=cfg.draft and shared_kv,
    )


def cp_rank_main(
    ctx: RankContext, cfg: SimConfig, steps: List[List[Request]], shard_impl: str = "plugin"
) -> RankResult:
    """One CP rank: CpHiRadixCache over the shared-KV allocator, the trace replayed."""
    from sglang_cp_hicache.sim.v0_5_12.driver import RankDriver
    from sglang_cp_hicache.sim.v0_5_12.faults import apply_fault
    from sglang_cp_hicache.sim.v0_5_12.observed_cache import ObservedCpHiRadixCache
    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import build_rank_stack

    if shard_impl != "plugin":  # LINE.check refuses it before any rank starts
        raise ValueError(f"SGLang {RELEASE} has no native KV sharding")
    setup_rank_process(cfg, f"cp rank {ctx.rank}")
    _apply_plugin_hooks()
    stack = build_rank_stack(
        stack_config(cfg, max_context_len(steps, cfg.page_size)),
        ctx.rank,
        ctx.cp_group,
        ctx.attn_tp_group,
        shared_kv=True,
        cache_cls=ObservedCpHiRadixCache,
    )
    hooks = apply_fault(cfg.fault, stack, ctx.rank, ctx.world_size, ctx.cp_group, len(steps))
    counter = CollectiveCounter()
    counter.install()
    try:
        driver = RankDriver(
            stack,
            ctx.rank,
            shared_kv=True,
            counter=counter,
            agree=lambda value: all_ranks_equal(value, ctx.cp_group),
            hooks=hooks,
            tree_digest_every=cfg.tree_digest_every,
            features=cfg.scheduler_features(LINE.resolved_per_layer_backup(cfg)),
        )
        show = cfg.progress and ctx.rank == 0
        return run_with_progress(
            lambda bar: driver.run(steps, bar), show, len(steps), f"cp={cfg.cp_size}"
        )
    finally:
        counter.uninstall()
        stack.close()


def baseline_rank_main(ctx: RankContext, cfg: SimConfig, steps: List[List[Request]]) -> RankResult:
    """Upstream non-CP HiRadixCache (cp 1) with the same physical pool as one CP rank.

    No plugin hooks: this is SGLang as shipped.
    """
    from sglang.srt.mem_cache import allocator as upstream_allocator

    from sglang_cp_hicache.sim.engine import FaultHooks
    from sglang_cp_hicache.sim.v0_5_12.driver import RankDriver
    from sglang_cp_hicache.sim.v0_5_12.observed_cache import ObservedUpstreamHiRadixCache
    from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch
    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import build_rank_stack

    setup_rank_process(cfg, "baseline")
    upstream_allocator.alloc_extend_kernel = NaiveExtendLaunch()
    stack = build_rank_stack(
        stack_config(cfg, max_context_len(steps, cfg.page_size), shared_kv=False),
        0,
        None,
        ctx.attn_tp_group,
        shared_kv=False,
        cache_cls=ObservedUpstreamHiRadixCache,
    )
    counter = CollectiveCounter()
    counter.install()
    try:
        driver = RankDriver(
            stack,
            0,
            shared_kv=False,
            counter=counter,
            agree=lambda value: True,
            hooks=FaultHooks(),
            tree_digest_every=cfg.tree_digest_every,
            features=cfg.scheduler_features(LINE.resolved_per_layer_backup(cfg)),
        )
        return run_with_progress(
            lambda bar: driver.run(steps, bar), cfg.progress, len(steps), "upstream cp=1"
        )
    finally:
        counter.uninstall()
        stack.close()


LINE = LineSim(
    release=RELEASE,
    native_sharding=False,
    per_layer_backup=PER_LAYER_BACKUP_DEFAULT,
    mem_layout=MEM_LAYOUT,
    sharded_main=cp_rank_main,
    upstream_main=baseline_rank_main,
    faults=tuple(sorted(PLANTED_FAULTS)),
)
