"""The 0.5.23 line's radix ops for ``bench_radix_ops.py``: the plugin's flag vs upstream's
native sharding on ``UnifiedRadixCache``, each against 0.5.23's default Rust tree core.

Two sessions of two gloo ranks (cp 2, ``testing.dist.run_ranks``), the same trees and calls
in each; rank 0 reports:

* ``native`` session: ``rust`` (the unsharded stack on 0.5.23's default Rust tree core, no
  collective) and ``native`` (upstream's sharded stack, ``--enable-kv-cache-sharding``,
  which forces the Python tree core), no plugin hooks;
* ``plugin`` session: ``rust`` again and ``plugin`` (the same sharded stack with the
  plugin's hooks applied as ``load_plugins`` applies them and its flag on the record).

Hooks patch SGLang's classes for the whole process, so ``native`` and ``plugin`` never share
one; inside a session the two variants take turns call by call. ``plugin/native`` compares
across sessions; the ``anchored`` ratio divides each by its own session's ``rust`` figure,
which cancels a load change between the sessions.

Operations (scheduler-path radix ops on a tree of one-page nodes): match_prefix (cached
path plus one new page), insert (a new leaf whose write-through backup is queued; checked
untimed), check_acked (``check_hicache_events`` until that backup is acked), backup_ack
(insert and check timed together), check_idle (the check with nothing pending: 0.5.23 still
runs its MIN all-reduce every call), evict of 1% of the tree. The sharded checks include
the MIN all-reduce over the two ranks; it is timed alone on the same group and reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import random
import sys
import time
from typing import Any, Dict, Iterator, List

import sglang_cp_hicache.testing

# A rank resolves its entry point from this file: radix_ops_common must be importable there.
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

sglang_cp_hicache.testing.install()

import torch  # noqa: E402

from radix_ops_common import (  # noqa: E402
    PAGE,
    Results,
    RunConfig,
    TreeShape,
    all_reduce_rank,
    interleaved_medians,
    timed,
)
from sglang_cp_hicache.testing.dist import RankContext, run_ranks  # noqa: E402

logger = logging.getLogger("bench_radix_ops")

CP_SIZE = 2  # two gloo ranks: the smallest sharded group, the real all-reduce
HOST_RATIO = 1.1  # host pool just above the device pool
CHECK_OPS = ("check_acked", "backup_ack", "check_idle")
OPS = ("match_prefix", "insert", *CHECK_OPS, "evict")
READY_COUNTS = 4  # the check's MIN-reduced tensor without storage: acks, loads, digest pair


@contextlib.contextmanager
def _rust_tree_core() -> Iterator[None]:
    """Caches built inside get 0.5.23's default Rust tree core: ``testing.v0_5_23.stack``
    builds with the Python one (the only one sharding accepts) and has no option for it,
    so the per-cache ``CacheInitParams.tree_core_backend`` (which wins over the env) is
    defaulted to ``"rust"`` for the build."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    init = CacheInitParams.__init__

    def rust_by_default(self, *args, **kwargs):
        kwargs.setdefault("tree_core_backend", "rust")
        init(self, *args, **kwargs)

    CacheInitParams.__init__ = rust_by_default
    try:
        yield
    finally:
        CacheInitParams.__init__ = init


class Bench:
    """One variant's stack on one tree; builds it through the scheduler's calls
    (``alloc_extend`` with the parent chain's rotation base, ``insert``, the check)."""

    def __init__(self, stack: Any, shape: TreeShape, group: Any) -> None:
        self.stack, self.cache, self.shape = stack, stack.cache, shape
        self.group = group  # the CP group: both ranks start each timed call together
        self.locs: List[torch.Tensor] = []  # each shape node's page: its logical locs
        self.handles: List[Any] = []  # each shape node's tree node id

    def _insert_node(self, node: int) -> None:
        """Allocate and insert shape node ``node`` (its parent is in the tree)."""
        path = self.shape.path(node)
        prefix = [self.locs[p] for p in path[:-1]]
        prefix_locs = torch.cat(prefix) if prefix else torch.empty(0, dtype=torch.int64)
        parent = self.shape.parent[node]
        base = None if parent < 0 else self.cache.rotation_base_of(self.handles[parent])
        locs, base = self.stack.alloc_extend(prefix_locs, len(path) * PAGE, base)
        result = self.stack.insert(
            self.shape.tokens(node), torch.cat([prefix_locs, locs]), base, cached_len=len(prefix_locs)
        )
        if result.rotation_tail_declined or result.last_device_node is None:
            raise RuntimeError(f"node {node}: the insert was declined ({result})")
        self.locs.append(locs[-PAGE:].clone())
        self.handles.append(result.last_device_node)

    def _check_until_acked(self) -> None:
        self.cache.check_hicache_events()
        while self.cache.ongoing_write_through:
            self.cache.check_hicache_events()

    def populate(self) -> None:
        for node in range(len(self.shape)):
            self._insert_node(node)
            self._check_until_acked()

    def time_op(self, op: str, rng: random.Random) -> float:
        return getattr(self, f"_{op}")(rng)

    def _timed(self, fn) -> float:
        """:func:`timed` after a barrier: a check's all-reduce then costs the call, not the
        other rank's lag from the untimed set-up."""
        torch.distributed.barrier(group=self.group)
        return timed(fn)

    def _new_leaf(self, rng: random.Random) -> int:
        return self.shape.extend(rng.randrange(len(self.locs)))

    def _match_prefix(self, rng: random.Random) -> float:
        tokens = self.shape.tokens(rng.randrange(len(self.locs))) + [0] * PAGE
        return self._timed(lambda: self.stack.match(tokens))

    def _insert(self, rng: random.Random) -> float:
        node = self._new_leaf(rng)
        elapsed = self._timed(lambda: self._insert_node(node))
        self._check_until_acked()
        return elapsed

    def _check_acked(self, rng: random.Random) -> float:
        self._insert_node(self._new_leaf(rng))
        assert self.cache.ongoing_write_through, "the new leaf's backup was not queued"
        return self._timed(self._check_until_acked)

    def _backup_ack(self, rng: random.Random) -> float:
        node = self._new_leaf(rng)

        def insert_and_ack() -> None:
            self._insert_node(node)
            self._check_until_acked()

        return self._timed(insert_and_ack)

    def _check_idle(self, rng: random.Random) -> float:
        assert not self.cache.ongoing_write_through
        return self._timed(self.cache.check_hicache_events)

    def _evict(self, rng: random.Random) -> float:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        num_tokens = len(self.shape) * PAGE // 100
        return self._timed(lambda: self.cache.evict(EvictParams(num_tokens=num_tokens)))


def _stack_config(num_nodes: int, cfg: RunConfig, shape: TreeShape, sharded: bool, plugin: bool):
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig

    pages = num_nodes + 4 * cfg.reps + max(8, num_nodes // 50)  # + the timed new leaves
    depth = max(len(shape.path(node)) for node in range(len(shape))) + 8  # leaves go deeper
    context = -(-depth * PAGE // (CP_SIZE * PAGE)) * CP_SIZE * PAGE
    return StackConfig(
        layer_num=1,
        device_pages_per_rank=-(-pages // CP_SIZE) + 2 if sharded else pages + 1,
        host_to_device_ratio=HOST_RATIO,
        kv_lora_rank=32,  # small rows: the tree, not the copy, is timed
        qk_rope_head_dim=32,
        context_len=context,
        chunk_tokens=context,
        cp_shared_kv=plugin,
    )


def _rank_main(ctx: RankContext, sizes: tuple, cfg: RunConfig, shard_impl: str) -> Dict[int, Any]:
    """One rank of a session: per size, the medians of ``rust`` and ``shard_impl`` and the
    all-reduce alone on the CP group."""
    from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack, build_unsharded_stack

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # a fresh process
    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger("sglang_cp_hicache").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    if shard_impl == "plugin":
        from sglang_cp_hicache.sim.v0_5_23.rank import _apply_plugin_hooks

        _apply_plugin_hooks()
    out = {}
    for size in sizes:
        shape = TreeShape(size, cfg.seed)
        with _rust_tree_core():
            rust = build_unsharded_stack(ctx.attn_tp_group, _stack_config(size, cfg, shape, False, False))
        assert type(rust.cache.tree_core).__name__ == "RustUnifiedTreeCore"
        sharded = build_sharded_stack(ctx, _stack_config(size, cfg, shape, True, shard_impl == "plugin"))
        benches = {
            "rust": Bench(rust, TreeShape(size, cfg.seed), ctx.cp_group),
            shard_impl: Bench(sharded, shape, ctx.cp_group),
        }
        for name, bench in benches.items():
            start = time.perf_counter()
            bench.populate()
            if ctx.rank == 0:
                elapsed = time.perf_counter() - start
                logger.info("%s %s %d nodes built in %.1f s", shard_impl, name, size, elapsed)
        gc.collect()
        gc.freeze()
        results = interleaved_medians(
            benches, OPS, lambda op: cfg.evict_reps if op == "evict" else cfg.reps, cfg.seed
        )
        all_reduce_s = all_reduce_rank(ctx, cfg.reps, READY_COUNTS)
        for stack in (rust, sharded):
            stack.close()
        gc.unfreeze()
        del benches, rust, sharded
        gc.collect()
        out[size] = (results, all_reduce_s)
    return out


def _session(sizes: tuple, cfg: RunConfig, shard_impl: str) -> Dict[int, Any]:
    return run_ranks(CP_SIZE, _rank_main, sizes, cfg, shard_impl, timeout_s=3600.0)[0]


def print_report(native: Dict[int, Any], plugin: Dict[int, Any]) -> None:
    print(
        f"{'nodes':>7} {'op':<13} {'rust(n) ms':>11} {'native ms':>10} {'rust(p) ms':>11} "
        f"{'plugin ms':>10} {'native/rust':>12} {'plugin/rust':>12} {'plugin/native':>14} {'anchored':>9}"
    )
    for size in native:
        (res_n, _), (res_p, _) = native[size], plugin[size]
        for op in OPS:
            rust_n, nat = res_n["rust"][op], res_n["native"][op]
            rust_p, plug = res_p["rust"][op], res_p["plugin"][op]
            print(
                f"{size:>7} {op:<13} {rust_n * 1e3:>11.4f} {nat * 1e3:>10.4f} {rust_p * 1e3:>11.4f} "
                f"{plug * 1e3:>10.4f} {nat / rust_n:>12.2f} {plug / rust_p:>12.2f} {plug / nat:>14.2f} "
                f"{(plug / rust_p) / (nat / rust_n):>9.2f}"
            )
    for size in native:
        (res_n, ar_n), (res_p, ar_p) = native[size], plugin[size]
        worst = max(res_p["plugin"][op] / res_n["native"][op] for op in OPS)
        share = " ".join(f"{op}={ar_n / res_n['native'][op]:.2f}" for op in CHECK_OPS)
        print(
            f"{size} nodes: worst plugin/native={worst:.2f}; all_reduce alone {ar_n * 1e6:.1f} us "
            f"(plugin session {ar_p * 1e6:.1f} us) at cp {CP_SIZE}, its share of native's {share}"
        )


def main(sizes: tuple, quick: bool) -> None:
    cfg = RunConfig(sizes=sizes, reps=51 if quick else 101, evict_reps=5 if quick else 9)
    native = _session(sizes, cfg, "native")
    plugin = _session(sizes, cfg, "plugin")
    print_report(native, plugin)
