"""The 0.5.12.post1 line's radix ops for ``bench_radix_ops.py``: upstream vs ours (CP off,
CP on at cp 8) on ``HiRadixCache``.

Variants, all alive in one process and taking turns call by call:

* ``upstream``: the original ``HiRadixCache`` (``UPSTREAM["HiRadixCache"]``), plain allocator;
* ``cp_off``: ``CpHiRadixCache`` with the plain allocator;
* ``cp_on``: ``CpHiRadixCache`` as rank 0 of cp 8 (owner-lane allocator, CP controller) in
  a single-rank gloo world, as the unit tests build it.

Operations: match_prefix (cached path plus one new page), insert (one new leaf, with its
write-through backup; its ack checked untimed), check_acked (``check_hicache_events`` until
the backup of a leaf just inserted is acked: the ack path), backup_ack (insert and check
until acked, timed together: what populating the tree costs per node), check_idle (the
check with nothing pending), write_backup + writing_check, evict of 1% of the tree's
tokens, evict_host of 1%, load-back planning (``init_load_back`` of a host-only node; the
H2D copy is not timed). Pools use NSA page size 64, one layer and small MLA dims, sized
just above the tree (100k nodes: about 7 GB for all three variants).

In a one-rank world neither upstream nor ours runs the ack MIN all-reduce (both skip a
group of one); at CP or TP > 1 both pay it once per check with backups pending. It is timed
alone at two gloo ranks, and the check ratio is given with it added to both sides.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from typing import Dict, Optional

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

from radix_ops_common import (  # noqa: E402
    PAGE,
    Results,
    RunConfig,
    TreeShape,
    all_reduce_alone,
    interleaved_medians,
    print_table,
    timed,
)
from sglang_cp_hicache.testing.dist import single_rank_world  # noqa: E402
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import UPSTREAM  # noqa: E402
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache  # noqa: E402

logger = logging.getLogger("bench_radix_ops")

CP_SIZE = 8
KV_LORA_RANK = QK_ROPE_HEAD_DIM = 32  # small MLA rows: the tree, not the copy, is timed
INDEX_HEAD_DIM = 128  # fixed by NSATokenToKVPool
HOST_RATIO = 1.02  # host pool just above the device pool (HostKVCache requires >)
VARIANTS = ("upstream", "cp_off", "cp_on")
CHECK_OPS = ("check_acked", "backup_ack", "check_idle")
IDLE_BATCH = 100  # check_idle calls per sample
OPS = ("match_prefix", "insert", *CHECK_OPS, "write_backup", "evict", "evict_host", "load_back")


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

    def _insert_backed_up_leaf(self, rng: random.Random) -> None:
        """A new leaf, inserted: write-through queues its backup, whose ack is pending."""
        self.cache.insert(self._new_leaf(rng, chunked=False))
        assert self.cache.ongoing_write_through, "the new leaf's backup was not queued"

    def _check_until_acked(self) -> None:
        while self.cache.ongoing_write_through:
            self.cache.check_hicache_events()

    def _check_acked(self, rng: random.Random) -> float:
        """check_hicache_events until the backup of the leaf just inserted is acked (the
        insert untimed): the ack path of every step that follows a backup."""
        self._insert_backed_up_leaf(rng)
        return timed(self._check_until_acked)

    def _backup_ack(self, rng: random.Random) -> float:
        """Insert a leaf (its write-through backup queued) and check until it is acked."""
        params = self._new_leaf(rng, chunked=False)

        def insert_and_ack() -> None:
            self.cache.insert(params)
            self._check_until_acked()

        return timed(insert_and_ack)

    def _check_idle(self, rng: random.Random) -> float:
        """check_hicache_events with nothing pending (the steady state between backups),
        per call of a batch of :data:`IDLE_BATCH`: one call is shorter than the timer's
        own overhead."""
        assert not self.cache.ongoing_write_through
        check = self.cache.check_hicache_events

        def batch() -> None:
            for _ in range(IDLE_BATCH):
                check()

        return timed(batch) / IDLE_BATCH

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


def bench_size(num_nodes: int, cfg: RunConfig, world, variants: tuple = VARIANTS) -> Results:
    """Medians per variant and operation (see :func:`interleaved_medians`)."""
    benches = {}
    for variant in variants:
        start = time.perf_counter()
        # + the new leaves the timed insert, check and backup ops add
        cache = build_cache(variant, num_nodes + 5 * cfg.reps, world)
        benches[variant] = Bench(cache, TreeShape(num_nodes, cfg.seed))
        benches[variant].populate()
        logger.info("%s %d nodes built in %.1f s", variant, num_nodes, time.perf_counter() - start)
    gc.collect()
    gc.freeze()  # the trees are long-lived: keep untimed collections short

    def after_op(op: str) -> None:
        if op == "evict":  # host eviction and load-back need host-only leaves
            for bench in benches.values():
                bench.demote_half()

    results = interleaved_medians(
        benches,
        OPS,
        lambda op: cfg.evict_reps if op.startswith("evict") else cfg.reps,
        cfg.seed,
        after_op,
    )
    for bench in benches.values():
        bench.cache.shutdown()
    gc.unfreeze()
    del benches
    gc.collect()
    return results


def ratios_line(results: Results) -> str:
    def speedup(op: str) -> float:
        return results["upstream"][op] / max(results["cp_off"][op], results["cp_on"][op])

    others = [op for op in OPS if op not in ("evict", "evict_host")]
    worst = max(results["cp_on"][op] / results["upstream"][op] for op in others)
    return f"ratios: evict={speedup('evict'):.2f} evict_host={speedup('evict_host'):.2f} worst_other={worst:.2f}"


def check_line(results: Results, all_reduce_s: float) -> str:
    """The ack path, CP on vs upstream: alone (one-rank world, no collective) and with the
    two-rank all-reduce added to both sides (what each pays per check at CP or TP > 1)."""
    up, on = results["upstream"], results["cp_on"]
    alone = " ".join(f"{op}={on[op] / up[op]:.2f}" for op in CHECK_OPS)
    with_ar = " ".join(
        f"{op}={(on[op] + all_reduce_s) / (up[op] + all_reduce_s):.2f}" for op in CHECK_OPS[:2]
    )
    return (
        f"check (cp_on/upstream): {alone}; all_reduce alone {all_reduce_s * 1e6:.1f} us at 2 "
        f"gloo ranks; with it: {with_ar}"
    )


def main(sizes: tuple, quick: bool, variants: Optional[tuple] = None) -> None:
    """``variants``: a subset of :data:`VARIANTS` holding ``upstream`` (the baseline)."""
    chosen = tuple(v for v in VARIANTS if v in (variants or VARIANTS))
    unknown = set(variants or ()) - set(VARIANTS)
    if unknown or "upstream" not in chosen:
        raise SystemExit(f"--variants: a subset of {','.join(VARIANTS)} with upstream (got {variants})")
    cfg = RunConfig(sizes=sizes, reps=101 if quick else 201, evict_reps=7 if quick else 11)
    world = single_rank_world()
    all_results = {size: bench_size(size, cfg, world, chosen) for size in cfg.sizes}
    print(f"variants: {','.join(chosen)}")
    print_table(all_results, OPS, baseline="upstream")
    largest = all_results[max(cfg.sizes)]
    if "cp_off" in chosen and "cp_on" in chosen:
        print(ratios_line(largest))
    if "cp_on" in chosen:
        print(check_line(largest, all_reduce_alone()))
