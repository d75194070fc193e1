"""A serving run: the main PD cluster every scenario uses, and the servers scenarios add.

The main cluster is one cp-1 decode server and two prefill servers of the same TP size, each
behind its own router on that decode: the **sharded** prefill (the plugin's flag, HiCache, on
lines that admit it an L3 file tier) and its **unsharded reference** (the same launch without
the flag, the same logical capacity). A scenario sends each request to both routers and
compares what comes back. Scenarios that need another server (a restarted one-rank L3
reader, a Mooncake-store prefill) start it behind its own router on the session's decode
(:meth:`ServingSession.behind_router`) and retire it when done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from sglang_cp_hicache.testing.server.cluster import Router, Server, ServingCluster
from sglang_cp_hicache.testing.server.launch import PrefillSpec, StorageSpec

logger = logging.getLogger(__name__)

SHARDED = "sharded"
REFERENCE = "reference"


WARM_UP_IDS = tuple(range(3, 3 + 40))  # under one page: nothing is cached


def warm_up(router: Router) -> None:
    """One short request through ``router``, so no scenario times a server's first request
    (its lazy imports and first allocations take seconds)."""
    from sglang_cp_hicache.testing.server.client import generate

    generate(router.url, WARM_UP_IDS, 2)


@dataclass
class ServingSession:
    cluster: ServingCluster
    tp: int
    storage: Optional[StorageSpec]
    decode: Server
    sharded: Server
    reference: Server
    sharded_router: Router
    reference_router: Router
    start_times: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, run_dir: Path, model: Path, tp: int = 2) -> "ServingSession":
        """Start the main cluster (servers together, then the routers); on any failure end
        what was started and raise."""
        cluster = ServingCluster(run_dir, model)
        try:
            storage = None
            if cluster.line.supports_storage_under_flag:
                storage = StorageSpec("file", directory=run_dir / "l3-file")
            decode = cluster.decode()
            sharded = cluster.prefill(PrefillSpec(SHARDED, tp=tp, storage=storage))
            reference = cluster.prefill(PrefillSpec(REFERENCE, tp=tp, sharded=False))
            times = cluster.start(decode, sharded, reference)
            routers = (
                cluster.router(f"router-{SHARDED}", sharded, decode),
                cluster.router(f"router-{REFERENCE}", reference, decode),
            )
            times.update(cluster.start(*routers))
            for router in routers:
                warm_up(router)
        except BaseException:
            cluster.close()
            raise
        return cls(cluster, tp, storage, decode, sharded, reference, *routers, start_times=times)

    @property
    def line(self):
        return self.cluster.line

    def restart_decode(self) -> Dict[str, float]:
        """A fresh decode server and fresh routers for both prefills (a router keeps a
        restarted worker marked unavailable)."""
        self.cluster.stop(self.sharded_router, self.reference_router, self.decode)
        self.decode = self.cluster.decode(self.decode.name)
        times = self.cluster.start(self.decode)
        self.sharded_router = self.cluster.router(self.sharded_router.name, self.sharded, self.decode)
        self.reference_router = self.cluster.router(self.reference_router.name, self.reference, self.decode)
        times.update(self.cluster.start(self.sharded_router, self.reference_router))
        self.start_times.update({f"{name} (restart)": s for name, s in times.items()})
        return times

    def behind_router(self, spec: PrefillSpec) -> Tuple[Server, Router, Dict[str, float]]:
        """Start a prefill of ``spec``, then its router on the session's decode."""
        server = self.cluster.prefill(spec)
        try:
            times = self.cluster.start(server)
            router = self.cluster.router(f"router-{spec.name}", server, self.decode)
            times.update(self.cluster.start(router))
        except BaseException:
            self.cluster.stop(server)
            raise
        self.start_times.update(times)
        return server, router, times

    def retire(self, *components) -> None:
        self.cluster.stop(*components)

    def running(self) -> List[str]:
        return self.cluster.running()

    def close(self) -> None:
        self.cluster.close()


__all__ = ["REFERENCE", "SHARDED", "ServingSession"]
