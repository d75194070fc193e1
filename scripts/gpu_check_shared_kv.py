"""Driver of scripts/gpu_check_shared_kv.sh: CP shared-KV prefill vs replicated KV.

``cp`` processes (gloo CP group) run one prefill forward with a cached prefix twice per
variant: every rank holding every page (replicated, upstream), and every rank holding only
its owned pages and materialising the prefix through the plugin's real hook functions
(shared, each strategy, with and without next-layer prefetch). Outputs must be identical.

* ``--device cuda``: all ranks on one GPU; SGLang's real ``NSATokenToKVPool`` at GLM-5
  dims (kv_lora_rank 512, rope 64, index head 128, page 64), so KV and index-K stores and
  index-K reads are SGLang's Triton kernels; materialisation runs on the GPU (side-stream
  prefetch). Sparse attention itself is the torch reference (FlashMLA needs model-shaped
  heads and is not driven here).
* ``--device cpu``: the same driver with the torch reference pool at tiny dims.
* ``--dry-run``: print the plan and exit.

Prints one ``PASS``/``FAIL`` line, then one timings line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, List, Optional, Sequence

STRATEGIES = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class CheckOptions:
    device: str
    cp_size: int
    timeout_s: float


@dataclass
class RankContext:
    rank: int
    world_size: int
    cp_group: Any


def variants() -> List[tuple]:
    return [(strategy, prefetch) for strategy in STRATEGIES for prefetch in (False, True)]


def _config_and_pool(device: str):
    from sglang_cp_hicache.testing.reference_sparse_mla import (
        TINY_CONFIG,
        ReferenceNSAPool,
        SparseMLAConfig,
    )
    from sglang_cp_hicache.testing.shared_kv_twin import TwinBatchSpec

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
    kernels = "SGLang NSATokenToKVPool Triton kernels" if options.device == "cuda" else "torch reference"
    return (
        f"plan: {options.cp_size} processes, gloo CP group, device={options.device}, pool={kernels}; "
        f"variants={variants()}; replicated vs shared KV, identical outputs required"
    )


def check_rank(ctx: RankContext, options: dict) -> dict:
    """One rank: the twin comparison for every variant. ``options`` is
    ``asdict(CheckOptions)``: plain values unpickle in any launcher's child."""
    import torch

    from sglang_cp_hicache.testing.shared_kv_twin import TwinRank, compare_shared_to_replicated

    options = CheckOptions(**options)
    config, spec, pool_factory, pool_name = _config_and_pool(options.device)
    device = "cuda:0" if options.device == "cuda" else "cpu"
    side_stream = torch.cuda.Stream() if options.device == "cuda" else None
    twin = TwinRank(config, spec, ctx.cp_group, ctx.rank, ctx.world_size, device, pool_factory)
    results = compare_shared_to_replicated(twin, variants(), side_stream)
    return {"pool": pool_name, "results": [asdict(r) for r in results]}


def summarize(per_rank: Sequence[dict], options: CheckOptions, wall_s: float) -> tuple[bool, List[str]]:
    failures = []
    for rank, report in enumerate(per_rank):
        for result in report["results"]:
            label = f"rank {rank} {result['strategy']}/prefetch={result['prefetch']}"
            if not result["identical"]:
                failures.append(f"{label}: max |shared - replicated| = {result['max_abs_diff']:.3g}")
            failures.extend(f"{label}: {p}" for p in result["pool_problems"])
    timings = ", ".join(
        f"{r['strategy']}/prefetch={int(r['prefetch'])} {max(rep['results'][i]['seconds'] for rep in per_rank) * 1e3:.0f} ms"
        for i, r in enumerate(per_rank[0]["results"])
    )
    head = f"cp={options.cp_size} device={options.device} pool={per_rank[0]['pool']}"
    if failures:
        lines = [f"FAIL shared-KV != replicated ({head}): {failures[0]} (+{len(failures) - 1} more)"]
    else:
        lines = [f"PASS shared-KV == replicated ({head}, {len(variants())} variants x {options.cp_size} ranks)"]
    lines.append(f"timings: {timings}; total {wall_s:.1f} s")
    return not failures, lines


# ----------------------------------------------------------------- process launch
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, world: int, port: int, fn: Callable, options: dict, queue) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=options["timeout_s"]),
        )
        queue.put((rank, True, fn(RankContext(rank, world, dist.group.WORLD), options)))
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
    parser = argparse.ArgumentParser(description="CP shared-KV prefill vs replicated KV")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    return CheckOptions(args.device, args.cp, args.timeout), args.dry_run


def main(argv: Optional[Sequence[str]] = None, launch: Callable = spawn_ranks) -> int:
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
    try:
        per_rank = launch(options.cp_size, check_rank, asdict(options))
    except Exception as exc:  # a rank crashed: report it as the one result line
        print(f"FAIL {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
        print(str(exc), file=sys.stderr)
        return 1
    ok, lines = summarize(per_rank, options, time.perf_counter() - start)
    for line in lines:
        print(line)
    if os.environ.get("GPU_CHECK_JSON"):
        with open(os.environ["GPU_CHECK_JSON"], "w") as f:
            json.dump(per_rank, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
