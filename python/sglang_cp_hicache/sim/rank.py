"""Entry points run in each simulated scheduler process (via ``testing.dist.run_ranks``)."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, List, Sequence

import torch

from sglang_cp_hicache.sim.collectives import CollectiveCounter, all_ranks_equal
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import RankResult
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing.dist import RankContext

if TYPE_CHECKING:
    from sglang_cp_hicache.sim.driver import RankDriver

# SGLang (and everything importing it) loads only inside the rank processes: they fork
# from a server that has it imported already, while the parent stays light.


def _setup_process(cfg: SimConfig, label: str) -> None:
    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s [{label}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # N ranks share this machine's cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)


def _apply_plugin_hooks() -> None:
    """Patch SGLang in this rank as ``load_plugins`` patches a scheduler process, so the
    driver's calls into SGLang's scheduler-path functions run the plugin's wrappers."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.v0_5_12.hooks import missing_hooks
    from sglang_cp_hicache.plugin import register

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not installed in the simulated rank: {missing}")


def _max_context_len(steps: Sequence[Sequence[Request]], page_size: int) -> int:
    longest = max(len(r.token_ids) for step in steps for r in step)
    return (longest // page_size + 2) * page_size


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, leave=False)


def _drive(driver: RankDriver, steps: List[List[Request]], show: bool, desc: str) -> RankResult:
    bar = _progress(show, len(steps), desc)
    try:
        return driver.run(steps, bar)
    finally:
        if bar is not None:
            bar.close()


def cp_rank_main(ctx: RankContext, cfg: SimConfig, steps: List[List[Request]]) -> RankResult:
    """One CP rank: CpHiRadixCache over the shared-KV allocator, the trace replayed."""
    from sglang_cp_hicache.sim.driver import RankDriver
    from sglang_cp_hicache.sim.faults import apply_fault
    from sglang_cp_hicache.sim.observed_cache import ObservedCpHiRadixCache
    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import build_rank_stack

    _setup_process(cfg, f"cp rank {ctx.rank}")
    _apply_plugin_hooks()
    stack = build_rank_stack(
        cfg.stack_config(_max_context_len(steps, cfg.page_size)),
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
            features=cfg.scheduler_features(),
        )
        return _drive(driver, steps, cfg.progress and ctx.rank == 0, f"cp={cfg.cp_size}")
    finally:
        counter.uninstall()
        stack.close()


def baseline_rank_main(ctx: RankContext, cfg: SimConfig, steps: List[List[Request]]) -> RankResult:
    """Upstream non-CP HiRadixCache (cp 1) with the same physical pool as one CP rank.

    No plugin hooks: this is SGLang as shipped.
    """
    from sglang.srt.mem_cache import allocator as upstream_allocator

    from sglang_cp_hicache.sim.driver import RankDriver
    from sglang_cp_hicache.sim.faults import FaultHooks
    from sglang_cp_hicache.sim.observed_cache import ObservedUpstreamHiRadixCache
    from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch
    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import build_rank_stack

    _setup_process(cfg, "baseline")
    upstream_allocator.alloc_extend_kernel = NaiveExtendLaunch()
    stack = build_rank_stack(
        cfg.stack_config(_max_context_len(steps, cfg.page_size), shared_kv=False),
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
            features=cfg.scheduler_features(),
        )
        return _drive(driver, steps, cfg.progress, "upstream cp=1")
    finally:
        counter.uninstall()
        stack.close()
