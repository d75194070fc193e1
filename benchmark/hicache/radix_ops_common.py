"""What both lines' radix-op benchmarks share: the tree shape, single-call timing, the
interleaved median loop, the table, and the MIN all-reduce timed alone at two gloo ranks.

Imports no SGLang (each line's module does, after the CPU runtime is installed).
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence

PAGE = 64  # NSA / DSA need it

Results = Dict[str, Dict[str, float]]  # variant -> op -> median seconds


@dataclass(frozen=True)
class RunConfig:
    sizes: tuple
    reps: int  # single calls per cheap operation (each adds or loads one node)
    evict_reps: int  # calls per eviction (each frees 1% of the tree)
    seed: int = 0


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

    def path(self, node: int) -> List[int]:
        """The nodes root -> ``node``."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[node]
        return nodes[::-1]

    def tokens(self, node: int) -> List[int]:
        return self.path_tokens(self.path(node))

    @staticmethod
    def path_tokens(path: Sequence[int]) -> List[int]:
        """The token ids of the nodes ``path`` (root first), one page each."""
        return [t for page in path for t in range(page * PAGE + 1, (page + 1) * PAGE + 1)]


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes, GC off (the trees are long-lived)."""
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def interleaved_medians(
    benches: Dict[str, Any],
    ops: Sequence[str],
    reps_of: Callable[[str], int],
    seed: int,
    after_op: Callable[[str], None] = lambda op: None,
) -> Results:
    """Median seconds of ``bench.time_op(op, rng)`` per variant and op. The variants take
    turns call by call (rotating who goes first), so load changes hit them alike; each
    variant's rng is seeded alike, so they draw the same nodes."""
    variants = list(benches)
    results: Results = {variant: {} for variant in variants}
    for op in ops:
        rngs = {variant: random.Random(f"{seed}-{op}") for variant in variants}
        samples: Dict[str, List[float]] = {variant: [] for variant in variants}
        for rep in range(reps_of(op)):
            turn = rep % len(variants)
            for variant in variants[turn:] + variants[:turn]:
                samples[variant].append(benches[variant].time_op(op, rngs[variant]))
        for variant in variants:
            results[variant][op] = statistics.median(samples[variant])
        after_op(op)
    return results


def print_table(all_results: Dict[int, Results], ops: Sequence[str], baseline: str) -> None:
    """One row per size and op: each variant's median (µs) and its ratio to ``baseline``."""
    variants = list(next(iter(all_results.values())))
    others = [v for v in variants if v != baseline]
    header = f"{'nodes':>7} {'op':<13}" + "".join(f" {v + ' us':>14}" for v in variants)
    header += "".join(f" {v + '/' + baseline:>16}" for v in others)
    print(header)
    for size, results in all_results.items():
        for op in ops:
            if op not in results[baseline]:
                continue
            base = results[baseline][op]
            row = f"{size:>7} {op:<13}" + "".join(f" {results[v][op] * 1e6:>14.3f}" for v in variants)
            row += "".join(f" {results[v][op] / base:>16.2f}" for v in others)
            print(row)


# ------------------------------------------------------------- the all-reduce alone
def all_reduce_rank(ctx: Any, reps: int, numel: int) -> float:
    """One rank: median seconds of a MIN all-reduce of ``numel`` ints on the CP group."""
    import torch
    import torch.distributed as dist

    tensor = torch.zeros(numel, dtype=torch.int64)
    for _ in range(20):  # connection set-up
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=ctx.cp_group)
    samples = []
    for _ in range(reps):
        dist.barrier(group=ctx.cp_group)  # both ranks enter together: the call, not the skew
        start = time.perf_counter()
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=ctx.cp_group)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def all_reduce_alone(reps: int = 501, numel: int = 1) -> float:
    """Median seconds of the write-ack MIN all-reduce (``numel`` counts) at two gloo ranks:
    what the ack check pays per call at CP or TP > 1, upstream's as much as ours."""
    from sglang_cp_hicache.testing.dist import run_ranks

    return max(run_ranks(2, all_reduce_rank, reps, numel))
