"""Microbenchmark: CP shared-KV prefix materialisation, dense all-reduce vs owner-packed all-gather.

Each rank holds the pages it owns of one request's cached prefix (random logical pages,
GLM-5 FP8 DSA byte layout by default: 656 B MLA latent + 132 B indexer K/scale per token),
builds the batch mapping, and times one layer's materialisation (launch + wait, slowest
rank) with each strategy.

    # CPU, gloo (2 and 4 ranks)
    PYTHONPATH=python .venv/bin/python benchmark/bench_cp_shared_kv_materialize.py
    # GPU, NCCL, one GPU per rank
    python benchmark/bench_cp_shared_kv_materialize.py --backend nccl --world-sizes 8 \
        --prefix-tokens 16384,65536,131072

Prints one table row per (world size, prefix, strategy) and the strategy that wins most
configurations.

    # Cost model only (arithmetic, no ranks): bytes per forward per rank per strategy,
    # NVLink time and the chunk's compute time per layer side by side
    PYTHONPATH=python python benchmark/bench_cp_shared_kv_materialize.py --model glm5 --prefix 131072 --cp 8
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import build_batch_mapping
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import (
    STRATEGIES,
    PoolPageReader,
    make_strategy,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cp_shared_kv_cost_model import MODELS  # noqa: E402
from cp_shared_kv_cost_model import report as cost_report  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    backend: str
    prefix_tokens: tuple
    page_size: int
    kv_bytes_per_token: int
    index_bytes_per_token: int
    chunk_tokens: int
    warmup: int
    iters: int


class BenchPool:
    """An NSA-shaped pool (uint8 store) holding ``num_pages`` pages plus the padding page."""

    def __init__(self, cfg: BenchConfig, num_pages: int, device):
        self.page_size = cfg.page_size
        self.start_layer = 0
        tokens = (num_pages + 1) * cfg.page_size
        self.kv_buffer = [torch.randint(0, 255, (tokens, 1, cfg.kv_bytes_per_token), dtype=torch.uint8, device=device)]
        self.index_k_with_scale_buffer = [
            torch.randint(0, 255, (num_pages + 1, cfg.page_size * cfg.index_bytes_per_token), dtype=torch.uint8, device=device)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_with_scale_buffer[layer_id]


def _time_strategy(strategy, mapping, reader, cfg: BenchConfig, device, group) -> List[float]:
    samples = []
    for i in range(cfg.warmup + cfg.iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        strategy.launch(mapping, reader, 0).wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank
        if i >= cfg.warmup:
            samples.append(float(elapsed))
    return samples


def _worker(rank: int, world: int, port: int, cfg: BenchConfig, queue) -> None:
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}" if cfg.backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        cfg.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    group = dist.group.WORLD
    rows = []
    for prefix in cfg.prefix_tokens:
        num_pages = -(-(prefix + cfg.chunk_tokens) // cfg.page_size)
        rng = np.random.default_rng(prefix)  # same pages on every rank
        logical = rng.permutation(num_pages * world)[:num_pages] + world
        layout = CpSharedKVLayout(world, rank, cfg.page_size)
        mapping = build_batch_mapping(layout, [logical], [prefix], device)
        pool = BenchPool(cfg, int(logical.max()) // world + 1, device)
        reader = PoolPageReader(pool)
        dense_mb = mapping.num_dense_pages * cfg.page_size * (cfg.kv_bytes_per_token + cfg.index_bytes_per_token) / 2**20
        for name in STRATEGIES:
            samples = _time_strategy(make_strategy(name, group), mapping, reader, cfg, device, group)
            rows.append((world, prefix, name, statistics.median(samples) * 1e3, max(samples) * 1e3, dense_mb,
                         mapping.plan.max_owned, mapping.plan.num_prefix_pages))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(world: int, cfg: BenchConfig) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=1800)
    for proc in procs:
        proc.join()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.device_count() > 1 else "gloo")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--prefix-tokens", default="4096,16384,65536")
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-bytes-per-token", type=int, default=656, help="GLM-5 FP8 DSA MLA latent")
    parser.add_argument("--index-bytes-per-token", type=int, default=132, help="fp8 index K + fp32 scale")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--model", choices=sorted(MODELS), help="print the cost model only (no ranks)")
    parser.add_argument("--prefix", type=int, default=131072, help="--model: cached prefix tokens")
    parser.add_argument("--cp", type=int, default=8, help="--model: CP size")
    parser.add_argument("--chunk", type=int, default=8192, help="--model: extend tokens per forward (all ranks)")
    parser.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8", help="--model: KV cache dtype")
    args = parser.parse_args(argv)
    if args.model:
        print("\n".join(cost_report(args.model, args.prefix, args.chunk, args.cp, args.kv_dtype == "fp8")))
        return
    cfg = BenchConfig(
        backend=args.backend,
        prefix_tokens=tuple(int(x) for x in args.prefix_tokens.split(",")),
        page_size=args.page_size,
        kv_bytes_per_token=args.kv_bytes_per_token,
        index_bytes_per_token=args.index_bytes_per_token,
        chunk_tokens=args.chunk_tokens,
        warmup=args.warmup,
        iters=args.iters,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = [row for world in (int(x) for x in args.world_sizes.split(",")) for row in run(world, cfg)]
    print(f"backend={cfg.backend}  page_size={cfg.page_size}  bytes/token={cfg.kv_bytes_per_token}+{cfg.index_bytes_per_token}  "
          f"chunk={cfg.chunk_tokens}  iters={cfg.iters}")
    print(f"{'cp':>3} {'prefix':>8} {'strategy':>11} {'median ms':>10} {'max ms':>9} {'dense MiB':>10} {'max owned':>10} {'prefix pages':>13}")
    wins: Counter = Counter()
    totals: Counter = Counter()
    for world, prefix in sorted({(r[0], r[1]) for r in rows}):
        group = [r for r in rows if r[0] == world and r[1] == prefix]
        for r in group:
            print(f"{r[0]:>3} {r[1]:>8} {r[2]:>11} {r[3]:>10.2f} {r[4]:>9.2f} {r[5]:>10.1f} {r[6]:>10} {r[7]:>13}")
            totals[r[2]] += r[3]
        wins[min(group, key=lambda r: r[3])[2]] += 1
    # Long prefixes dominate prefill cost, so the total time decides, not the win count.
    winner = min(totals, key=totals.get)
    summary = ", ".join(f"{name} {totals[name]:.1f} ms / {wins[name]} wins" for name in sorted(totals))
    print(f"winner: {winner} (lowest total median time over {len(rows) // len(totals)} configurations: {summary})")


if __name__ == "__main__":
    main()
