"""PD in the simulator (``SimConfig.pd``): the main column's ranks as PD prefill servers.

With ``pd`` on, the main column's cp ranks run as processes of a :class:`~sglang_cp_hicache.
testing.pd.PDCluster` instead of ``run_ranks``: the same rank body (the line's real stack and
driver, the same trace), plus, for every request whose prefill finishes, a real transfer
through upstream's PD prefill path (bootstrap queue, ``MooncakeKVSender``, the plugin's owner
filters) over Mooncake on loopback to one decode process with a full, unsharded pool, which
checks every byte it received. Rank 0 announces each transfer (rid, tokens, room); this module
relays it to the decode process, which preallocates for it, so prefill and decode meet in
finish order without either knowing the trace.

This module imports no SGLang: each line's roles live in ``sim/<line>/pd.py`` as
:class:`LinePD` (``PD``), chosen by the installed release like the line's driver.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing.connection
import time
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import PDDecodeStats, RankResult
from sglang_cp_hicache.sim.workload import Request

logger = logging.getLogger(__name__)

#: Rank 0's event announcing one transfer (payload: the line's request spec), and the
#: decode role's reply name for it (payload None: no more requests).
TRANSFER_EVENT = "transfer"
DECODE_REQUEST = "request"
_DECODE_READY_S = 120.0  # the decode process: runtime, stack, transfer engine


@dataclass(frozen=True)
class LinePD:
    """One line's PD roles for the simulator.

    ``prefill_role(channel, rank, cfg, steps, ports, shard_impl) -> RankResult`` is one rank
    of the main column with its transfers; ``decode_role(channel, cfg, ports, decode_pages)
    -> PDDecodeStats`` the decode server, serving the relayed requests until told to stop.
    """

    prefill_role: Callable
    decode_role: Callable


def line_pd(line_module: str) -> LinePD:
    """The PD roles of the line ``sim.<line_module>`` (ValueError, naming what is missing,
    where that line has none)."""
    module = importlib.import_module(f"sglang_cp_hicache.sim.{line_module}.pd")
    if module.PD is None:
        raise ValueError(f"pd=True: {module.MISSING}")
    return module.PD


def decode_pages_for(steps: Sequence[Sequence[Request]], page_size: int) -> int:
    """Decode pool pages: room for the longest prompt twice (its free pages scattered),
    plus spare; the decode releases every request once checked."""
    longest = max(len(r.token_ids) for step in steps for r in step)
    return 2 * -(-longest // page_size) + 8


def run_pd_column(
    pd: LinePD, cfg: SimConfig, steps: Sequence[Sequence[Request]], shard_impl: str
) -> Tuple[List[RankResult], PDDecodeStats]:
    """The main column on ``cfg.cp_size`` prefill processes, each finished prefill
    transferred to (and checked on) one decode process. Raises ``RankFailed`` naming the
    role that failed or timed out; every process is ended on return."""
    from sglang_cp_hicache.testing.dist import RankFailed
    from sglang_cp_hicache.testing.pd import PDCluster, RoleFailed

    names = [f"prefill{r}" for r in range(cfg.cp_size)]
    try:
        with PDCluster(lifetime_s=cfg.timeout_s + 60) as cluster:
            cluster.start_bootstrap()
            decode_pages = decode_pages_for(steps, cfg.page_size)
            decode = cluster.start("decode", pd.decode_role, cfg, cluster.ports, decode_pages)
            decode.wait_event("ready", _DECODE_READY_S)
            for rank, name in enumerate(names):
                cluster.start(name, pd.prefill_role, rank, cfg, list(steps), cluster.ports, shard_impl)
            results = _relay(cluster, names, decode, cfg.timeout_s)
            decode.reply(DECODE_REQUEST, None)
            stats = decode.wait_result(60.0)
    except RoleFailed as error:
        raise RankFailed(f"PD column: {error}") from None
    return [results[n] for n in names], stats


def _relay(cluster, names: List[str], decode, timeout_s: float) -> dict:
    """Forward rank 0's transfer announcements to the decode role until every prefill
    rank returned its result; any role's failure (decode's included) raises at once."""
    from sglang_cp_hicache.testing.pd import RoleFailed

    deadline = time.monotonic() + timeout_s
    ranks = [cluster.roles[n] for n in names]
    relayed = 0
    while not all(r.done for r in ranks):
        for role in ranks + [decode]:
            while not role.done and (role.conn.poll(0) or not role.process.is_alive()):
                kind, name, payload = role.next_message(timeout_s=5.0)
                if kind == "event" and name == TRANSFER_EVENT:
                    decode.reply(DECODE_REQUEST, payload)
                    relayed += 1
                role.events.clear()  # relayed at once; nothing waits on them later
            if role is decode and decode.done:
                raise RoleFailed("decode: returned before the prefill ranks finished")
        if time.monotonic() > deadline:
            pending = [r.name for r in ranks if not r.done]
            raise RoleFailed(f"no result from {pending} within {timeout_s:.0f} s ({relayed} transfers relayed)")
        multiprocessing.connection.wait([r.conn for r in ranks + [decode] if not r.done], timeout=0.2)
    logger.info("PD: %d transfers relayed to the decode process", relayed)
    return {r.name: r.result for r in ranks}


__all__ = ["LinePD", "TRANSFER_EVENT", "DECODE_REQUEST", "decode_pages_for", "line_pd", "run_pd_column"]
