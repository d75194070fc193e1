"""CPU timing of ``alloc_extend`` for one long request: CP owner-lane allocator vs upstream.

Upstream ``PagedTokenToKVPoolAllocator.alloc_extend`` launches a Triton kernel, which
cannot run on CPU; here its launch is replaced by upstream's pure-torch reference
``alloc_extend_naive`` so both sides run the real ``alloc_extend`` method.

    PYTHONPATH=python .venv/bin/python benchmark/bench_alloc_extend.py
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import List

import sglang_cp_hicache.testing

sglang_cp_hicache.testing.install()

import torch  # noqa: E402
from sglang.srt.mem_cache import allocator as upstream_allocator  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402

from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch  # noqa: E402

logger = logging.getLogger("bench_alloc_extend")


def median_seconds(allocator, args, repeats: int) -> float:
    """Median wall time of ``alloc_extend(*args)``, allocator state restored between runs."""
    state = allocator.backup_state()
    timings: List[float] = []
    for _ in range(repeats):
        allocator.restore_state(state)
        start = time.perf_counter()
        locs = allocator.alloc_extend(*args)
        timings.append(time.perf_counter() - start)
        if locs is None:
            raise RuntimeError("pool too small for the benchmark request")
    allocator.restore_state(state)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # stable figures on shared CI boxes

    page_size, cp_size = args.page_size, args.cp_size
    # Every page of the request fits into one lane, whatever the owner pattern.
    physical_size = (args.tokens // page_size + 2) * page_size
    prefix = torch.tensor([0])
    seq = torch.tensor([args.tokens])
    last_loc = torch.tensor([-1])  # no cached prefix: nothing to continue
    extend_args = (prefix, prefix.clone(), seq, seq.clone(), last_loc, args.tokens)

    upstream_allocator.alloc_extend_kernel = NaiveExtendLaunch()
    upstream = PagedTokenToKVPoolAllocator(
        physical_size * cp_size, page_size, torch.int8, "cpu", None, False
    )
    upstream_s = median_seconds(upstream, extend_args, args.repeats)
    logger.info("tokens=%d cp=%d page=%d repeats=%d", args.tokens, cp_size, page_size, args.repeats)
    logger.info(
        "upstream PagedTokenToKVPoolAllocator (alloc_extend_naive): median %.3f ms",
        upstream_s * 1e3,
    )
    ours = CPSharedPagedTokenToKVPoolAllocator(
        physical_size, page_size, torch.int8, "cpu", None, False, cp_size, 0
    )
    ours_s = median_seconds(ours, extend_args, args.repeats)
    logger.info(
        "CPSharedPagedTokenToKVPoolAllocator (balanced pages): median %.3f ms, ratio to "
        "upstream %.2fx",
        ours_s * 1e3,
        ours_s / upstream_s,
    )


if __name__ == "__main__":
    main()
