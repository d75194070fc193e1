"""PD in the simulator (``SimConfig.pd``): the main column's ranks as PD prefill servers.

With ``pd`` on, the main column's cp ranks run as processes of a :class:`~sglang_cp_hicache.
testing.pd.roles.PDCluster` instead of ``run_ranks``: the same rank body (the line's real stack and
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
from typing import Any, Callable, List, Optional, Sequence, Tuple

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import PDDecodeStats, PDRankStats, RankResult
from sglang_cp_hicache.sim.workload import Request

logger = logging.getLogger(__name__)

#: Rank 0's event announcing one transfer (payload: the line's request spec), and the
#: decode role's reply name for it (payload None: no more requests).
TRANSFER_EVENT = "transfer"
DECODE_REQUEST = "request"
_DECODE_READY_S = 120.0  # the decode process: runtime, stack, transfer engine
# A column's roles live at most this long, however long its trace: the relay's limit is
# per transfer (cfg.timeout_s), and a role ends itself once the harness is gone.
PD_ROLE_LIFETIME_S = 6 * 3600.0


@dataclass(frozen=True)
class LinePD:
    """One line's PD roles for the simulator.

    ``prefill_role(channel, rank, cfg, steps, ports, shard_impl) -> RankResult`` is one rank
    of the main column with its transfers; ``decode_role(channel, cfg, ports, decode_pages)
    -> PDDecodeStats`` the decode server, serving the relayed requests until told to stop.
    """

    prefill_role: Callable
    decode_role: Callable


_ROOM_BASE = 1 << 20  # bootstrap rooms of one run: unique per transfer, equal on every rank


class PrefillLink:
    """One prefill rank's transfers: every finished request, whole prompt as one last chunk.

    ``server`` is the line's harness ``PrefillRank`` over the driver's own stack (its
    ``send_prefilled``), so the pages sent are the ones the trace left, at their physical
    ids; ``owned(page_locs)`` is the line's owner test of a request's first logical slot of
    each page. Rank 0 announces each transfer to the harness (relayed to decode) before it
    bootstraps; every rank then takes the same request through upstream's path, in the
    same order.
    """

    def __init__(self, channel: Any, rank: int, server: Any, page_size: int, owned: Callable[[Any], Any]):
        self.channel, self.rank, self.server = channel, rank, server
        self.page_size, self.owned = page_size, owned
        kv_args = server.kv_manager.kv_args
        page_bytes = sum(kv_args.kv_item_lens) + sum(sum(lens) for lens in kv_args.state_item_lens)
        self.stats = PDRankStats(page_bytes=page_bytes)

    def transfer(self, rid: str, token_ids: Sequence[int], req_pool_idx: int) -> None:
        """Send one finished prefill (its KV at ``req_to_token[req_pool_idx]``) and wait for
        the CP-wide outcome; a failure is recorded, the run goes on."""
        import torch

        from sglang_cp_hicache.testing.pd.scenario import PDRequest

        spec = PDRequest(rid, tuple(token_ids), room=_ROOM_BASE + self.stats.requests)
        if self.rank == 0:
            self.channel.event(TRANSFER_EVENT, spec)
        out = self.server.send_prefilled(spec, req_pool_idx)
        row = self.server.stack.req_to_token_pool.req_to_token[req_pool_idx, : len(token_ids)]
        owned_at = self.owned(row[:: self.page_size].to(torch.int64)).nonzero().flatten().tolist()
        s = self.stats
        s.requests += 1
        s.tokens += len(token_ids)
        s.pages += -(-len(token_ids) // self.page_size)
        s.owned_pages += out.owned_pages
        s.sent_bytes += out.payload_bytes
        s.transfer_s.append(out.transfer_s)
        s.engine_s += out.engine_s
        s.count_owned_positions(owned_at)
        if not out.success:
            s.failures.append(f"{rid}: {out.failure or 'failed'}")


_pending: Optional[Callable[[Any], PrefillLink]] = None  # this process's link to be


def expect(open_link: Callable[[Any], PrefillLink]) -> None:
    """This process is a PD prefill role: the driver built next gets ``open_link(stack)``."""
    global _pending
    _pending = open_link


def attach(stack: Any) -> Optional[PrefillLink]:
    """The driver's link to decode, over its ``stack``, if this process is a PD prefill
    role (:func:`expect` ran before the rank body built the stack); else None. Every rank
    waits on a CP barrier after registering with the bootstrap server (in ``open_link``):
    decode asks for the prefill's parallel info at the first transfer and gives up after a
    few tries, so a rank still building its stack would fail it."""
    global _pending
    if _pending is None:
        return None
    open_link, _pending = _pending, None
    return open_link(stack)


def serve_relayed(channel: Any, timeout_s: float, server: Any, free_slots: Callable[[], int]) -> PDDecodeStats:
    """The decode role's loop, either line: each relayed request received and checked by
    ``server`` (the line harness's ``DecodeServer``) and released, until the harness sends
    None; then the off-grant and leak checks (``free_slots()``: the decode allocator's)."""
    free_before = free_slots()
    channel.event("ready")
    stats = PDDecodeStats()
    while (spec := channel.wait(DECODE_REQUEST, timeout_s=timeout_s)) is not None:
        out = server.serve(spec, keep=False)
        stats.requests += 1
        stats.transfer_s.append(out.transfer_s)
        if not out.success:
            stats.failures.append(f"{spec.rid}: {out.failure}")
            continue
        stats.tokens += len(spec.token_ids)
        stats.kv_mismatches += out.kv_mismatches
        stats.draft_kv_mismatches += out.draft_mismatches
        stats.aux_mismatches += int(not out.aux_ok)
    stats.off_grant_pages_changed = server.report([]).off_grant_pages_changed
    stats.leaked_tokens = free_before - free_slots()
    return stats


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
    from sglang_cp_hicache.testing.pd.roles import PDCluster, RoleFailed

    names = [f"prefill{r}" for r in range(cfg.cp_size)]
    try:
        with PDCluster(lifetime_s=PD_ROLE_LIFETIME_S) as cluster:
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
    rank returned its result; any role's failure (decode's included) raises at once, and
    ``timeout_s`` without a transfer or a result raises naming the silent ranks."""
    from sglang_cp_hicache.testing.pd.roles import RoleFailed

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
                    deadline = time.monotonic() + timeout_s  # progress: the limit restarts
                role.events.clear()  # relayed at once; nothing waits on them later
            if role is decode and decode.done:
                raise RoleFailed("decode: returned before the prefill ranks finished")
        if time.monotonic() > deadline:
            pending = [r.name for r in ranks if not r.done]
            raise RoleFailed(
                f"no result from {pending} within {timeout_s:.0f} s of the last transfer "
                f"({relayed} transfers relayed)"
            )
        multiprocessing.connection.wait([r.conn for r in ranks + [decode] if not r.done], timeout=0.2)
    logger.info("PD: %d transfers relayed to the decode process", relayed)
    return {r.name: r.result for r in ranks}


__all__ = [
    "DECODE_REQUEST",
    "LinePD",
    "PrefillLink",
    "TRANSFER_EVENT",
    "attach",
    "decode_pages_for",
    "expect",
    "line_pd",
    "run_pd_column",
    "serve_relayed",
]
