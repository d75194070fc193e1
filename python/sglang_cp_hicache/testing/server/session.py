"""A serving run: the main PD cluster every scenario uses, and the servers scenarios add.

The main cluster is one cp-1 decode server and two prefill servers of the same TP size, each
behind its own router on that decode: the **sharded** prefill (the plugin's flag, HiCache, on
lines that admit it an L3 file tier) and its **unsharded reference** (the same launch without
the flag, the same logical capacity and the same tiers: an L3 file tier of its own, in its own
folder, wherever the sharded prefill has one). A scenario sends each request to both routers
and compares what comes back. A caller may add prefills of its own to the start
(``extra``: the serving benchmark's third configuration), each behind its own router. On a line whose unsharded CP reference is exact for the first
token only (``LineLaunch.decode_reference_tp``), a third, one-rank unsharded prefill answers
for the decode tokens. Scenarios that need another server (a restarted one-rank L3
reader, a Mooncake-store prefill) start it behind its own router on the session's decode
(:meth:`ServingSession.behind_routers`) and retire it when done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.testing.server.cluster import Router, Server, ServingCluster
from sglang_cp_hicache.testing.server.launch import PrefillSpec, StorageSpec

logger = logging.getLogger(__name__)

SHARDED = "sharded"
REFERENCE = "reference"
DECODE_REFERENCE = "reference-decode"


WARM_UP_IDS = tuple(range(3, 3 + 40))  # under one page: nothing is cached


def warm_up(router: Router) -> None:
    """One short request through ``router``, so no scenario times a server's first request
    (its lazy imports and first allocations take seconds)."""
    from sglang_cp_hicache.testing.server.client import generate

    generate(router.url, WARM_UP_IDS, 2)


def l3_file_tier(run_dir: Path, name: str) -> StorageSpec:
    """A prefill's own L3 file tier: its own folder in the run folder (``l3-file`` for the
    sharded prefill, ``l3-file-<name>`` for any other)."""
    return StorageSpec("file", directory=run_dir / ("l3-file" if name == SHARDED else f"l3-file-{name}"))


@dataclass
class ServingSession:
    cluster: ServingCluster
    tp: int
    storage: Optional[StorageSpec]  # the sharded prefill's L3 tier (None: the line admits none)
    decode: Server
    sharded: Server
    reference: Server
    sharded_router: Router
    reference_router: Router
    decode_reference: Optional[Server] = None
    decode_reference_router: Optional[Router] = None
    start_times: Dict[str, float] = field(default_factory=dict)
    #: the caller's own prefills started with the main cluster, by name: (server, router)
    extra: Dict[str, Tuple[Server, Router]] = field(default_factory=dict)

    @classmethod
    def start(cls, run_dir: Path, model: Path, tp: int = 2, extra: Sequence[PrefillSpec] = ()) -> "ServingSession":
        """Start the main cluster and ``extra`` prefills (servers together, then the routers);
        on any failure end what was started and raise."""
        cluster = ServingCluster(run_dir, model)
        try:
            storage = l3_file_tier(run_dir, SHARDED) if cluster.line.supports_storage_under_flag else None
            reference_storage = l3_file_tier(run_dir, REFERENCE) if storage is not None else None
            decode = cluster.decode()
            events = cluster.line.publishes_kv_events
            specs = [
                PrefillSpec(SHARDED, tp=tp, storage=storage, kv_events=events),
                PrefillSpec(REFERENCE, tp=tp, sharded=False, storage=reference_storage, kv_events=events),
            ]
            decode_tp = cluster.line.decode_reference_tp
            if decode_tp is not None:
                specs.append(PrefillSpec(DECODE_REFERENCE, tp=decode_tp, sharded=False))
            prefills = [cluster.prefill(spec) for spec in [*specs, *extra]]
            times = cluster.start(decode, *prefills)
            routers = [cluster.router(f"router-{p.name}", p, decode) for p in prefills]
            times.update(cluster.start(*routers))
            for router in routers:
                warm_up(router)
        except BaseException:
            cluster.close()
            raise
        main = len(specs)
        decode_ref = (prefills[2], routers[2]) if decode_tp is not None else (None, None)
        extras = {p.name: (p, r) for p, r in zip(prefills[main:], routers[main:])}
        return cls(cluster, tp, storage, decode, prefills[0], prefills[1], routers[0], routers[1], *decode_ref,
                   start_times=times, extra=extras)  # fmt: skip

    @property
    def line(self):
        return self.cluster.line

    def restart_decode(self) -> Dict[str, float]:
        """A fresh decode server and fresh routers for every prefill (a router keeps a
        restarted worker marked unavailable)."""
        old = [r for r in (self.sharded_router, self.reference_router, self.decode_reference_router) if r]
        old += [router for _, router in self.extra.values()]
        self.cluster.stop(*old, self.decode)
        self.decode = self.cluster.decode(self.decode.name)
        times = self.cluster.start(self.decode)
        fresh = [self.cluster.router(r.name, r.prefill, self.decode, r.also, r.policy, r.extra_args) for r in old]
        times.update(self.cluster.start(*fresh))
        self.sharded_router, self.reference_router = fresh[:2]
        if self.decode_reference_router is not None:
            self.decode_reference_router = fresh[2]
        extra_routers = fresh[len(fresh) - len(self.extra):]
        self.extra = {name: (server, router) for (name, (server, _)), router in zip(self.extra.items(), extra_routers)}
        self.start_times.update({f"{name} (restart)": s for name, s in times.items()})
        return times

    def behind_routers(self, *specs: PrefillSpec) -> Tuple[List[Server], List[Router], Dict[str, float]]:
        """Start prefills of ``specs`` together, then each one's router on the session's
        decode; their start times. On any failure end what was started and raise."""
        servers = [self.cluster.prefill(spec) for spec in specs]
        routers: List[Router] = []
        try:
            times = self.cluster.start(*servers)
            routers = [self.cluster.router(f"router-{s.name}", s, self.decode) for s in servers]
            times.update(self.cluster.start(*routers))
        except BaseException:
            self.cluster.stop(*routers, *servers)
            raise
        self.start_times.update(times)
        return servers, routers, times

    def retire(self, *components) -> None:
        self.cluster.stop(*components)

    def running(self) -> List[str]:
        return self.cluster.running()

    def close(self) -> None:
        self.cluster.close()


__all__ = ["DECODE_REFERENCE", "REFERENCE", "SHARDED", "ServingSession", "l3_file_tier"]
