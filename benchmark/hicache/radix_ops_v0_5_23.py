"""The 0.5.23 line's radix ops for ``bench_radix_ops.py``: the plugin's flag and hooks vs
upstream's native sharding on ``UnifiedRadixCache``, and 0.5.23's default Rust tree core.

One session of two gloo ranks (cp 2, ``testing.dist.run_ranks``); rank 0 reports. Each
rank holds three stacks over the same tree, which take turns call by call (a load change
hits them alike):

* ``rust``: the unsharded stack on 0.5.23's default Rust tree core (no collective);
* ``native``: upstream's sharded stack (``--enable-kv-cache-sharding``, which forces the
  Python tree core), no plugin hooks;
* ``plugin``: the same sharded stack with the plugin's flag on its record and the
  plugin's hooks applied as ``load_plugins`` applies them.

Hooks patch SGLang's classes and modules for the whole process, so the session applies
them once and then switches them (:class:`HookSwitch`: every patched attribute, and every
``from module import name`` alias the registry rebound) on for ``plugin``'s calls and off
for the others', set-up untimed. ``rust`` and ``native`` thus run upstream's code exactly;
the plugin's record is published last (upstream's radix paths read no process-wide args
at run time; the plugin's lane-aware hooks read the flag there).

Operations (scheduler-path radix ops on a tree of one-page nodes): match_prefix (cached
path plus one new page), alloc (``alloc_for_extend`` of one admitted request, a cached path
plus one new page, as the scheduler calls it: the plugin's lane-aware extend room and the
chain's base; released untimed), insert (a new leaf whose write-through backup is queued;
checked untimed), check_acked (``check_hicache_events`` until that backup is acked),
backup_ack (insert and check timed together), check_idle (the check with nothing pending:
0.5.23 runs its MIN all-reduce every call; the plugin skips it on every rank together while
the replicated pending maps are empty, ``v0_5_23/cache/event_sync.py``), evict (``evict`` of
1% of the tree), evict_for_alloc (the allocator's entry: room for 1% of the tree beyond what
is free; the plugin's is the lane-aware planner). The sharded checks include the MIN
all-reduce over the two ranks where they run it; it is timed alone on the same group and
reported as its share of native's checks.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
VARIANTS = ("rust", "native", "plugin")
CHECK_OPS = ("check_acked", "backup_ack", "check_idle")
EVICT_OPS = ("evict", "evict_for_alloc")
OPS = ("match_prefix", "alloc", "insert", *CHECK_OPS, *EVICT_OPS)
READY_COUNTS = 4  # the check's MIN-reduced tensor without storage: acks, loads, digest pair
# Nodes inserted between the set-up's checks. The final state does not depend on it: the
# pools hold the whole tree, so nothing is evicted or freed while backups are pending, and
# the host slots are taken at insert time, in insert order.
POPULATE_BATCH = 1024
_MISSING = object()


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


# ------------------------------------------------------------------- the hook switch
@dataclass
class _Slot:
    """One attribute the plugin's hooks changed: upstream's value and the hooked one."""

    owner: Any  # a class or a module
    name: str
    upstream: Any  # _MISSING: not in the owner's own dict (inherited) before the hooks
    hooked: Any


def _raw(owner: Any, name: str) -> Any:
    return vars(owner).get(name, _MISSING)


def _set(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


class HookSwitch:
    """The plugin's 0.5.23 hooks, applied once in this process (``register`` then
    ``HookRegistry.apply_hooks``, as ``load_plugins`` does) and then switched per call.

    Invariant: with the switch off every patched attribute, and every module alias the
    registry's propagation rebound, holds upstream's object again; on, the hooked one."""

    def __init__(self) -> None:
        from sglang_cp_hicache.hook_table import resolve
        from sglang_cp_hicache.sim.v0_5_23.rank import _apply_plugin_hooks
        from sglang_cp_hicache.v0_5_23.hooks import HOOKS

        targets: List[Tuple[Any, str]] = []
        for spec in HOOKS:  # every target imported first: patched now, aliases known
            importlib.import_module(spec.module)
            owner_path, _, name = spec.target.rpartition(".")
            if ":" not in owner_path:  # a module-level function
                owner_path, name = spec.target.split(":")
            targets.append((resolve(owner_path), name))
        before = [(owner, name, _raw(owner, name)) for owner, name in targets]
        originals = {id(getattr(owner, name)): getattr(owner, name) for owner, name in targets}
        aliases = [
            (module, name, value)
            for module in list(sys.modules.values())
            if module is not None and hasattr(module, "__dict__")
            for name, value in list(vars(module).items())
            if id(value) in originals and value is originals[id(value)]
        ]
        _apply_plugin_hooks()  # as load_plugins does; refused with a hook missing
        self.slots = [
            _Slot(owner, name, value, _raw(owner, name))
            for owner, name, value in before + aliases
            if _raw(owner, name) is not value
        ]
        if len({(id(s.owner), s.name) for s in self.slots}) < len(targets):
            raise RuntimeError("a plugin hook target was not patched by apply_hooks")
        self.on = True
        self.switch(False)

    def switch(self, on: bool) -> None:
        if on == self.on:
            return
        for slot in self.slots:
            _set(slot.owner, slot.name, slot.hooked if on else slot.upstream)
        self.on = on


# ------------------------------------------------------------------------- workload
class Bench:
    """One variant's stack on one tree; builds it through the scheduler's calls
    (``alloc_extend`` with the parent chain's rotation base, ``insert``, the check)."""

    def __init__(
        self, stack: Any, shape: TreeShape, group: Any, hooks: Optional[HookSwitch], hooked: bool
    ) -> None:
        self.stack, self.cache, self.shape = stack, stack.cache, shape
        self.group = group  # the CP group: both ranks start each timed call together
        self.hooks, self.hooked = hooks, hooked
        self.locs: List[torch.Tensor] = []  # each shape node's page: its logical locs
        self.handles: List[Any] = []  # each shape node's tree node id
        self.evicted_tokens: List[int] = []  # per evict_for_alloc call

    def enter(self) -> None:
        """This variant's code: the plugin's hooks on for ``plugin``, off otherwise."""
        if self.hooks is not None:
            self.hooks.switch(self.hooked)

    def _insert_node(self, node: int) -> None:
        """Allocate and insert shape node ``node`` (its parent is in the tree)."""
        path = self.shape.path(node)
        prefix = [self.locs[p] for p in path[:-1]]
        prefix_locs = torch.cat(prefix) if prefix else torch.empty(0, dtype=torch.int64)
        parent = self.shape.parent[node]
        base = None if parent < 0 else self.cache.rotation_base_of(self.handles[parent])
        locs, base = self.stack.alloc_extend(prefix_locs, len(path) * PAGE, base)
        result = self.stack.insert(
            TreeShape.path_tokens(path), torch.cat([prefix_locs, locs]), base, cached_len=len(prefix_locs)
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
        """Insert the whole tree, checking the backups every :data:`POPULATE_BATCH` nodes
        (set-up: one all-reduce and one merged write per batch, not per node). GC is off:
        the build only adds long-lived objects, which every collection would walk again."""
        self.enter()
        gc.disable()
        try:
            for node in range(len(self.shape)):
                self._insert_node(node)
                if node % POPULATE_BATCH == POPULATE_BATCH - 1:
                    self._check_until_acked()
            self._check_until_acked()
        finally:
            gc.enable()

    def time_op(self, op: str, rng: random.Random) -> float:
        self.enter()
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

    def _alloc(self, rng: random.Random) -> float:
        """``alloc_for_extend`` of one admitted request (a cached path and one new page);
        the request released untimed as a retraction releases it (its slots, row, lock)."""
        from sglang.srt.mem_cache.allocation import alloc_for_extend
        from sglang.srt.mem_cache.common import release_kv_cache

        path = self.shape.tokens(rng.randrange(len(self.locs)))
        batch = _admitted_batch(self.stack, path + [NEW_PAGE_TOKEN] * PAGE)
        elapsed = self._timed(lambda: alloc_for_extend(batch))
        release_kv_cache(batch.reqs[0], self.cache, checkpoint=False)
        return elapsed

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

    def _evict_tokens(self) -> int:
        return len(self.shape) * PAGE // 100

    def _evict(self, rng: random.Random) -> float:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        params = EvictParams(num_tokens=self._evict_tokens())
        return self._timed(lambda: self.cache.evict(params))

    def _evict_for_alloc(self, rng: random.Random) -> float:
        """The allocator's eviction entry (``evict_to_free_tokens`` calls it when short):
        room for 1% of the tree beyond the free pages."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        params = EvictParams(num_tokens=self._evict_tokens())
        result: List[Any] = []
        elapsed = self._timed(lambda: result.append(self.cache.evict_for_alloc(params)))
        self.evicted_tokens.append(result[0].num_tokens_evicted)
        return elapsed


NEW_PAGE_TOKEN = 1 << 30  # the timed alloc's new page: a token no tree path holds


def _admitted_batch(stack: Any, prompt: List[int]) -> Any:
    """One request over ``prompt`` matched (``init_next_round_input``) and admitted by a
    ``PrefillAdder``, in an extend ``ScheduleBatch`` with the fields ``prepare_for_extend``
    sets before ``alloc_for_extend``."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    cache = stack.cache
    adder = PrefillAdder(
        PAGE, cache, stack.allocator, ScheduleBatch(reqs=[], batch_is_full=False), 0.0, 1 << 20, None
    )
    req = Req(
        rid="alloc", origin_input_text="", origin_input_ids=array("q", prompt),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )  # fmt: skip
    req.init_next_round_input(cache)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    if adder.can_run_list != [req]:
        raise RuntimeError("the timed alloc's request was not admitted")
    batch = ScheduleBatch(
        reqs=[req], req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator, tree_cache=cache,
        model_config=SimpleNamespace(is_encoder_decoder=False), device="cpu",
    )  # fmt: skip
    batch.forward_mode = ForwardMode.EXTEND
    batch.prefix_lens, batch.extend_lens = [req.prefix_len], [req.extend_len]
    batch.seq_lens_cpu = torch.tensor([req.extend_end], dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    batch.extend_num_tokens = req.extend_len
    return batch


def _stack_config(num_nodes: int, cfg: RunConfig, shape: TreeShape, sharded: bool, plugin: bool):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

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


@dataclass
class SizeResult:
    """One size's medians (seconds) per variant and op, the all-reduce alone, and the
    tokens each variant's evict_for_alloc calls evicted (median)."""

    results: Results
    all_reduce_s: float
    evict_for_alloc_tokens: Dict[str, float]
    build_s: Dict[str, float]


def _build_stack(ctx: RankContext, variant: str, size: int, cfg: RunConfig, shape: TreeShape, hooks):
    """One variant's stack (pools sized to the tree), the hooks switched as it needs."""
    from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack, build_unsharded_stack

    hooks.switch(variant == "plugin")
    if variant == "rust":
        with _rust_tree_core():
            stack = build_unsharded_stack(ctx.attn_tp_group, _stack_config(size, cfg, shape, False, False))
        assert type(stack.cache.tree_core).__name__ == "RustUnifiedTreeCore"
        return stack
    return build_sharded_stack(ctx, _stack_config(size, cfg, shape, True, variant == "plugin"))


def _rank_main(
    ctx: RankContext, sizes: tuple, cfg: RunConfig, variants: Tuple[str, ...]
) -> Dict[int, SizeResult]:
    """One rank: per size, the variants' medians and the all-reduce alone."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # a fresh process
    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger("sglang_cp_hicache").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    hooks = HookSwitch()  # off: upstream's code
    out = {}
    for size in sizes:
        shape = TreeShape(size, cfg.seed)
        # VARIANTS order: the plugin's stack last, so its record is the process's
        stacks = {name: _build_stack(ctx, name, size, cfg, shape, hooks) for name in variants}
        benches = {
            name: Bench(stack, TreeShape(size, cfg.seed), ctx.cp_group, hooks, name == "plugin")
            for name, stack in stacks.items()
        }
        build_s = {}
        for name, bench in benches.items():
            start = time.perf_counter()
            bench.populate()
            build_s[name] = time.perf_counter() - start
            if ctx.rank == 0:
                logger.info("%s %d nodes built in %.1f s", name, size, build_s[name])
        gc.collect()
        gc.freeze()
        results = interleaved_medians(
            benches,
            OPS,
            lambda op: cfg.evict_reps if op in EVICT_OPS else cfg.reps,
            cfg.seed,
        )
        hooks.switch(False)
        all_reduce_s = all_reduce_rank(ctx, cfg.reps, READY_COUNTS)
        tokens = {name: statistics.median(b.evicted_tokens) for name, b in benches.items()}
        for stack in stacks.values():
            stack.close()
        gc.unfreeze()
        del benches, stacks
        gc.collect()
        out[size] = SizeResult(results, all_reduce_s, tokens, build_s)
    return out


_RATIOS = (("native", "rust"), ("plugin", "rust"), ("plugin", "native"))


def print_report(report: Dict[int, SizeResult]) -> None:
    variants = list(next(iter(report.values())).results)
    ratios = [(a, b) for a, b in _RATIOS if a in variants and b in variants]
    print(f"variants: {','.join(variants)}")
    print(
        f"{'nodes':>7} {'op':<16}"
        + "".join(f" {v + ' ms':>10}" for v in variants)
        + "".join(f" {a + '/' + b:>14}" for a, b in ratios)
    )
    for size, sized in report.items():
        res = sized.results
        print(
            "\n".join(
                f"{size:>7} {op:<16}"
                + "".join(f" {res[v][op] * 1e3:>10.4f}" for v in variants)
                + "".join(f" {res[a][op] / res[b][op]:>14.2f}" for a, b in ratios)
                for op in OPS
            )
        )
    for size, sized in report.items():
        res, ar = sized.results, sized.all_reduce_s
        parts = [f"{size} nodes:"]
        if "plugin" in res and "native" in res:
            worst = max(OPS, key=lambda op: res["plugin"][op] / res["native"][op])
            parts.append(f"worst plugin/native={res['plugin'][worst] / res['native'][worst]:.2f} ({worst});")
        parts.append(f"all_reduce alone {ar * 1e6:.1f} us at cp {CP_SIZE}")
        sharded = next((v for v in ("native", "plugin") if v in res), None)
        if sharded is not None:
            share = " ".join(f"{op}={ar / res[sharded][op]:.2f}" for op in CHECK_OPS)
            parts.append(f"its share of {sharded}'s {share};")
        if "plugin" in res and "native" in res:
            saved = (res["native"]["check_idle"] - res["plugin"]["check_idle"]) * 1e6
            parts.append(f"check_idle: the plugin's skip saves {saved:.1f} us a call;")
        tokens = " ".join(f"{v}={sized.evict_for_alloc_tokens[v]:.0f}" for v in variants)
        built = " ".join(f"{v}={sized.build_s[v]:.1f}s" for v in variants)
        parts.append(f"evict_for_alloc tokens per call {tokens}; built in {built}")
        print(" ".join(parts))


def main(sizes: tuple, quick: bool, variants: Optional[Tuple[str, ...]] = None) -> None:
    """``variants``: a subset of :data:`VARIANTS` (default all; each rank holds every
    chosen stack's pools, ``rust`` twice a sharded one's pages)."""
    chosen = tuple(v for v in VARIANTS if v in (variants or VARIANTS))
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown or not chosen:
        raise SystemExit(f"--variants: choose from {','.join(VARIANTS)} (got {sorted(unknown) or 'none'})")
    cfg = RunConfig(sizes=sizes, reps=51 if quick else 101, evict_reps=5 if quick else 9)
    # run_ranks' limit is on the whole session: 100k nodes build for tens of minutes per variant
    report = run_ranks(CP_SIZE, _rank_main, sizes, cfg, chosen, timeout_s=3 * 3600.0)[0]
    print_report(report)
