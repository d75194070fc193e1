"""A Mooncake store that outlives simulator runs, for a restart through it at another cp
size (``SimConfig.storage_mooncake_master``, ``--storage-mooncake-master``)::

    python -m sglang_cp_hicache.sim.v0_5_23.held_store --segment-mb 2048 &
    python -m sglang_cp_hicache.sim --workload l3 --cp-size 2 --mem-layout page_first \\
        --storage-backend mooncake --storage-mooncake-master 127.0.0.1:PORT
    python -m sglang_cp_hicache.sim --workload l3 --cp-size 4 ... (the same master)

A ``mooncake_master`` on loopback and a ``mooncake_client`` holding one segment
(``testing/v0_5_23/mooncake_store.held_mooncake_store``); prints the master's address, runs until
SIGTERM or SIGINT, then stops both by their pids.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import held_mooncake_store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment-mb", type=int, default=1024, help="the held segment's size")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with held_mooncake_store(args.segment_mb << 20) as master:
        print(master, flush=True)  # the one line a script reads
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
