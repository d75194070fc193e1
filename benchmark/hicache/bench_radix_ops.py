"""CPU timing of the HiCache radix ops on the scheduler path, plugin vs upstream, on the
installed SGLang line; ratios against upstream measured in the same run.

* 0.5.12.post1 (``.venv``, ``radix_ops_v0_5_12.py``): upstream ``HiRadixCache`` vs
  ``CpHiRadixCache`` with CP off and CP on (rank 0 of cp 8); default 1k and 10k nodes,
  ``--large`` adds 100k.
* 0.5.23 (``.venv-sglang-0.5.23``, ``radix_ops_v0_5_23.py``): ``UnifiedRadixCache`` on
  upstream's sharded Python tree core (``native``) vs the same stack under the plugin's flag
  and hooks (``plugin``), at cp 2 (two gloo ranks), and 0.5.23's default Rust tree core
  unsharded (``rust``), all three in the same ranks taking turns call by call (the hooks
  switched on for the plugin's calls only); default 1k and 10k nodes, ``--large`` adds
  100k.

Both time ``check_hicache_events`` after a backup (``check_acked``: the insert untimed, then
the check until its ack pops; ``backup_ack``: insert and check timed together) and with
nothing pending (``check_idle``), and say what part of it is the write-ack MIN all-reduce
(which upstream at CP or TP > 1 pays too). Each figure is the median of single calls, GC
off while timing; the variants in one process take turns call by call.

    PYTHONPATH=python .venv/bin/python benchmark/hicache/bench_radix_ops.py [--large] [--sizes 10000,100000]
    PYTHONPATH=python .venv-sglang-0.5.23/bin/python benchmark/hicache/bench_radix_ops.py [--large]
    ... [--variants native,plugin]   # a subset of the line's variants (memory at 100k)

Figures and how to read them: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the line modules beside it

from sglang_cp_hicache.core.releases import line_package  # noqa: E402

SMALL_SIZES = (1_000, 10_000)
LARGE_SIZES = (1_000, 10_000, 100_000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="add 100k nodes (minutes per variant)")
    parser.add_argument("--quick", action="store_true", help="fewer calls per op (a smoke run)")
    parser.add_argument(
        "--sizes", type=lambda text: tuple(int(n) for n in text.split(",")),
        help="comma-separated node counts instead of the defaults (e.g. 10000,100000)",
    )  # fmt: skip
    parser.add_argument(
        "--variants", type=lambda text: tuple(text.split(",")),
        help="comma-separated subset of the line's variants (default all; 0.5.23: rust,native,plugin, "
        "0.5.12: upstream,cp_off,cp_on); fewer stacks per process when memory is short",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger("sglang_cp_hicache").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # stable figures on shared CI boxes

    line = line_package().rsplit(".", 1)[1]  # refuses an unsupported release
    module = importlib.import_module(f"radix_ops_{line}")
    sizes = args.sizes or (LARGE_SIZES if args.large else SMALL_SIZES)
    module.main(sizes, args.quick, args.variants)


if __name__ == "__main__":
    main()
