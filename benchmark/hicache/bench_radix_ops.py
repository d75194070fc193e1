"""CPU timing of HiRadixCache hot-path operations: upstream vs ours (CP off, CP on at cp 8).

One run times, on trees of one-page nodes (1k, 10k, 100k nodes; ``--quick``: 1k, 10k):

* ``upstream``: the original ``HiRadixCache`` (``UPSTREAM["HiRadixCache"]``), plain allocator;
* ``cp_off``: ``CpHiRadixCache`` with the plain allocator;
* ``cp_on``: ``CpHiRadixCache`` as rank 0 of cp 8 (owner-lane allocator, CP controller) in
  a single-rank gloo world, as the unit tests build it.

Operations: match_prefix (cached path plus one new page), insert (one new leaf, with its
write-through backup), write_backup + writing_check, evict of 1% of the tree's tokens,
evict_host of 1%, load-back planning (``init_load_back`` of a host-only node; the H2D copy
is not timed). Each figure is the median of single calls (GC off while timing); the three
variants stay alive and take turns call by call, so machine load hits them alike. Pools use
NSA page size 64, one layer and small MLA dims, sized just above the tree (100k nodes:
about 7 GB for all three variants).

The last line sums up the largest size:
``ratios: evict=<upstream/ours> evict_host=<upstream/ours> worst_other=<cp_on/upstream>``
where "ours" is the slower of cp_off and cp_on, and worst_other the largest cp_on/upstream
ratio among the other operations.

    PYTHONPATH=python .venv/bin/python benchmark/hicache/bench_radix_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import sglang_cp_hicache.testing

sglang_cp_hicache.testing.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import UPSTREAM  # noqa: E402
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache  # noqa: E402
from sglang_cp_hicache.testing.dist import single_rank_world  # noqa: E402

logger = logging.getLogger("bench_radix_ops")

PAGE = 64  # NSA requires it
CP_SIZE = 8
KV_LORA_RANK = QK_ROPE_HEAD_DIM = 32  # small MLA rows: the tree, not the copy, is timed
INDEX_HEAD_DIM = 128  # fixed by NSATokenToKVPool
HOST_RATIO = 1.02  # host pool just above the device pool (HostKVCache requires >)
VARIANTS = ("upstream", "cp_off", "cp_on")
OPS = ("match_prefix", "insert", "write_backup", "evict", "evict_host", "load_back")


@dataclass(frozen=True)
class RunConfig:
    sizes: tuple
    reps: int  # single calls per cheap operation (each adds or loads one node)
    evict_reps: int  # calls per eviction (each frees 1% of the tree)
    seed: int = 0


# --------------------------------------------------------------------- tree shape
class TreeShape:
    """A random recursive tree of one-page nodes: node ``i`` extends the sequence of a
    uniformly chosen earlier node (or starts a new one). About half the nodes are leaves,
    depth grows like ln(N). Token ids are unique per node, so keys never collide."""

    def __init__(self, num_nodes: int, seed: int) -> None:
        rng = random.Random(seed)
        self.parent = [rng.randrange(-1, i) for i in range(num_nodes)]

    def __len__(self) -> int:
        return len(self.parent)

    def extend(self, parent: int) -> int:
        self.parent.append(parent)
        return len(self.parent) - 1

    def tokens(self, node: int) -> List[int]:
        pages = []
        while node >= 0:
            pages.append(node)
            node = self.parent[node]
        return [t for page in reversed(pages) for t in range(page * PAGE + 1, (page + 1) * PAGE + 1)]


# --------------------------------------------------------------------- stacks
def _server_args() -> ServerArgs:
    args = ServerArgs(
        model_path="dummy",
        page_size=PAGE,
        enable_hierarchical_cache=True,
        hicache_ratio=HOST_RATIO,
        hicache_write_policy="write_through",
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
    )
    args._handle_hicache()  # model_path="dummy" skips it in __post_init__
    return args


def build_cache(variant: str, num_nodes: int, world):
    """A one-layer NSA stack whose device pool holds ``num_nodes`` one-page nodes."""
    cp = variant == "cp_on"
    pages = num_nodes + max(8, num_nodes // 50)
    device_pages = -(-pages // CP_SIZE) + 2 if cp else pages + 1
    tokens = device_pages * PAGE
    kv_pool = NSATokenToKVPool(
        tokens,
        page_size=PAGE,
        kv_lora_rank=KV_LORA_RANK,
        dtype=torch.bfloat16,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        layer_num=1,
        device="cpu",
        index_head_dim=INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=KV_LORA_RANK + QK_ROPE_HEAD_DIM,
    )
    common = dict(page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False)
    if cp:
        allocator = CPSharedPagedTokenToKVPoolAllocator(
            tokens, cp_size=CP_SIZE, cp_rank=0, **common
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(tokens, **common)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(8, 64, device="cpu", enable_memory_saver=False),
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=world,
        attn_cp_cache_group=None,
        attn_tp_cache_group=world,
        eviction_policy="lru",
    )
    cache_cls = UPSTREAM["HiRadixCache"] if variant == "upstream" else CpHiRadixCache
    return cache_cls(params=params, server_args=_server_args())


# --------------------------------------------------------------------- workload
def timed(fn: Callable[[], object]) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


class Bench:
    """One variant on one tree: builds it, then times single calls of each operation."""

    def __init__(self, cache, shape: TreeShape) -> None:
        self.cache, self.shape = cache, shape
        self.allocator = cache.token_to_kv_pool_allocator

    def insert_params(self, node: int, chunked: bool = False) -> InsertParams:
        tokens = self.shape.tokens(node)
        # The cached prefix's values are the tree's own (insert ignores them for nodes on
        # device); only the new page needs real slots.
        value = torch.cat([torch.zeros(len(tokens) - PAGE, dtype=torch.int64), self.allocator.alloc(PAGE)])
        return InsertParams(key=RadixKey(tokens), value=value, chunked=chunked)

    def populate(self) -> None:
        """Insert the whole tree, each node backed up on the way (write-through).

        The backups skip their byte copies (nothing reads them here, and the CPU copy
        kernels would dominate set-up time); the timed operations copy for real.
        """
        host_pool = self.cache.cache_controller.mem_pool_host
        host_pool.backup_from_device_all_layer = lambda *args, **kwargs: None
        try:
            for node in range(len(self.shape)):
                self.cache.insert(self.insert_params(node))
                self.cache.check_hicache_events()
        finally:
            del host_pool.backup_from_device_all_layer

    def time_op(self, op: str, rng: random.Random) -> float:
        """Seconds one call of ``op`` takes (set-up and clean-up untimed)."""
        return getattr(self, f"_{op}")(rng)

    def demote_half(self) -> None:
        """Half the device tokens go host-only: host eviction and load-back need host
        leaves to choose from."""
        self.cache.evict(EvictParams(num_tokens=self.cache.evictable_size() // 2))

    def _new_leaf(self, rng: random.Random, chunked: bool) -> InsertParams:
        return self.insert_params(self.shape.extend(rng.randrange(len(self.shape))), chunked)

    def _match_prefix(self, rng: random.Random) -> float:
        tokens = self.shape.tokens(rng.randrange(len(self.shape))) + [0] * PAGE
        key = RadixKey(tokens)
        return timed(lambda: self.cache.match_prefix(MatchPrefixParams(key=key)))

    def _insert(self, rng: random.Random) -> float:
        params = self._new_leaf(rng, chunked=False)
        elapsed = timed(lambda: self.cache.insert(params))
        self.cache.check_hicache_events()
        return elapsed

    def _write_backup(self, rng: random.Random) -> float:
        params = self._new_leaf(rng, chunked=False)
        controller = self.cache.cache_controller
        policy, controller.write_policy = controller.write_policy, "write_back"
        try:  # under write_back an insert backs nothing up (chunked leaves are, now)
            self.cache.insert(params)
        finally:
            controller.write_policy = policy
        leaf = self.cache.match_prefix(MatchPrefixParams(key=params.key)).last_device_node
        assert not leaf.backuped

        def write():
            self.cache.write_backup(leaf)
            self.cache.writing_check()

        return timed(write)

    def _evict(self, rng: random.Random) -> float:
        num_tokens = len(self.shape) * PAGE // 100
        return timed(lambda: self.cache.evict(EvictParams(num_tokens=num_tokens)))

    def _evict_host(self, rng: random.Random) -> float:
        num_tokens = len(self.shape) * PAGE // 100
        if getattr(self.cache, "uses_cp_hicache", False):
            # CP host eviction makes room lane by lane for a backup: ask for the lane
            # pages of the 1% least recently used host leaves beyond what is free.
            oldest = self.cache.evictable_host_leaves.ordered()[: num_tokens // PAGE]
            table = self.cache.host_table
            wanted = np.sum([np.asarray(node.cp_host_lanes) for node in oldest], axis=0)
            lane_pages = (wanted + np.asarray(table.lane_free_pages())).tolist()
            return timed(lambda: self.cache._make_host_room(lane_pages))
        return timed(lambda: self.cache.evict_host(num_tokens))

    def _load_back(self, rng: random.Random) -> float:
        while True:
            key = RadixKey(self.shape.tokens(rng.randrange(len(self.shape))))
            match = self.cache.match_prefix(MatchPrefixParams(key=key))
            if match.host_hit_length > 0:
                break
        params = InitLoadBackParams(
            best_match_node=match.best_match_node, host_hit_length=match.host_hit_length
        )
        elapsed = timed(lambda: self.cache.init_load_back(params))
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()
        return elapsed


def bench_size(num_nodes: int, cfg: RunConfig, world) -> Dict[str, Dict[str, float]]:
    """Medians per variant and operation. All variants stay alive and take turns call by
    call (rotating who goes first), so load changes on the machine hit them alike."""
    benches = {}
    for variant in VARIANTS:
        start = time.perf_counter()
        cache = build_cache(variant, num_nodes + 2 * cfg.reps, world)  # + timed new leaves
        benches[variant] = Bench(cache, TreeShape(num_nodes, cfg.seed))
        benches[variant].populate()
        logger.info("%s %d nodes built in %.1f s", variant, num_nodes, time.perf_counter() - start)
    gc.collect()
    gc.freeze()  # the trees are long-lived: keep untimed collections short

    results = {variant: {} for variant in VARIANTS}
    for op in OPS:
        rngs = {variant: random.Random(f"{cfg.seed}-{op}") for variant in VARIANTS}
        samples = {variant: [] for variant in VARIANTS}
        for rep in range(cfg.evict_reps if op.startswith("evict") else cfg.reps):
            turn = rep % len(VARIANTS)
            for variant in VARIANTS[turn:] + VARIANTS[:turn]:
                samples[variant].append(benches[variant].time_op(op, rngs[variant]))
        for variant in VARIANTS:
            results[variant][op] = statistics.median(samples[variant])
        if op == "evict":
            for bench in benches.values():
                bench.demote_half()

    for bench in benches.values():
        bench.cache.shutdown()
    gc.unfreeze()
    del benches
    gc.collect()
    return results


# --------------------------------------------------------------------- report
def print_table(all_results: Dict[int, Dict[str, Dict[str, float]]]) -> None:
    print(f"{'nodes':>7} {'op':<13} {'upstream ms':>12} {'cp_off ms':>10} {'cp_on ms':>10} "
          f"{'off/up':>7} {'on/up':>7}")
    for size, results in all_results.items():
        for op in OPS:
            up, off, on = (results[v][op] for v in VARIANTS)
            print(f"{size:>7} {op:<13} {up * 1e3:>12.3f} {off * 1e3:>10.3f} {on * 1e3:>10.3f} "
                  f"{off / up:>7.2f} {on / up:>7.2f}")


def ratios_line(results: Dict[str, Dict[str, float]]) -> str:
    def speedup(op: str) -> float:
        return results["upstream"][op] / max(results["cp_off"][op], results["cp_on"][op])

    others = [op for op in OPS if op not in ("evict", "evict_host")]
    worst = max(results["cp_on"][op] / results["upstream"][op] for op in others)
    return f"ratios: evict={speedup('evict'):.2f} evict_host={speedup('evict_host'):.2f} worst_other={worst:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 10k nodes only")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger("sglang_cp_hicache").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # stable figures on shared CI boxes

    sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
    cfg = RunConfig(sizes=sizes, reps=101 if args.quick else 201, evict_reps=7 if args.quick else 11)
    world = single_rank_world()
    all_results = {size: bench_size(size, cfg, world) for size in cfg.sizes}
    print_table(all_results)
    print(ratios_line(all_results[max(cfg.sizes)]))


if __name__ == "__main__":
    main()
