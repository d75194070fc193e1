"""One 0.5.12.post1 prefill rank's link to the decode process in the simulator (``SimConfig.pd``).

:class:`PrefillLink` is the harness's ``PrefillRank`` (upstream's ``PrefillBootstrapQueue``,
``MooncakeKVManager``, ``send_kv_chunk``, the CP-all-reduced poll) over the driver's own
stack, so the pages sent are the ones the trace left, at their physical ids. The PD prefill
role (``sim/v0_5_12/pd.py``) announces the link with :func:`expect` before the rank body
builds its stack; the driver takes it with :func:`attach` (None in every other process).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.distributed

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.pd import TRANSFER_EVENT
from sglang_cp_hicache.sim.results import PDRankStats

_ROOM_BASE = 1 << 20  # bootstrap rooms of one run: unique per transfer, equal on every rank


class PrefillLink:
    """One prefill rank's transfers: every finished request, whole prompt as one last chunk.

    Rank 0 announces each transfer to the harness (relayed to decode) before it bootstraps;
    every rank then takes the same request through upstream's path, in the same order.
    """

    def __init__(self, channel: Any, ctx: Any, cfg: SimConfig, ports: Any, stack: Any):
        from sglang_cp_hicache.testing.v0_5_12 import pd_harness, scheduler_batch

        self.channel, self.rank, self.harness = channel, ctx.rank, pd_harness
        scenario = pd_harness.PDScenario(
            cp_size=cfg.cp_size, steps=(), draft=cfg.draft, layer_num=cfg.layer_num,
        )  # fmt: skip
        with scheduler_batch.cpu_scheduler_server_args(cfg.page_size):
            self.server = pd_harness.PrefillRank(ctx, scenario, ports, stack=stack)
        # Serve once every rank has registered with the bootstrap server: decode asks it
        # for the prefill's parallel info at the first transfer and gives up after a few
        # tries (a slow rank still building its stack made the first transfer fail).
        torch.distributed.barrier(group=ctx.cp_group)
        kv_args = self.server.kv_manager.kv_args
        page_bytes = sum(kv_args.kv_item_lens) + sum(sum(lens) for lens in kv_args.state_item_lens)
        self.page_size = cfg.page_size
        self.stats = PDRankStats(page_bytes=page_bytes)

    def transfer(self, rid: str, token_ids: Sequence[int], req_pool_idx: int) -> None:
        """Send one finished prefill (its KV at ``req_to_token[req_pool_idx]``) and wait for
        the CP-wide outcome; a failure is recorded, the run goes on."""
        spec = self.harness.PDRequest(rid, tuple(token_ids), room=_ROOM_BASE + self.stats.requests)
        if self.rank == 0:
            self.channel.event(TRANSFER_EVENT, spec)
        out = self.server.send_prefilled(spec, req_pool_idx)
        s = self.stats
        s.requests += 1
        s.tokens += len(token_ids)
        s.pages += -(-len(token_ids) // self.page_size)
        s.owned_pages += out.owned_pages
        s.sent_bytes += out.payload_bytes
        s.transfer_s.append(out.transfer_s)
        s.engine_s += out.engine_s
        if not out.success:
            s.failures.append(f"{rid}: {out.failure or 'failed'}")


_pending: Optional[tuple] = None  # (channel, ctx, cfg, ports): this process's link to be


def attach(stack: Any) -> Optional[PrefillLink]:
    """The driver's link to decode, over its ``stack``, if this process is a PD prefill
    role (:func:`expect` ran before the rank body built the stack); else None."""
    global _pending
    if _pending is None:
        return None
    channel, ctx, cfg, ports = _pending
    _pending = None
    return PrefillLink(channel, ctx, cfg, ports, stack)


def expect(channel: Any, ctx: Any, cfg: SimConfig, ports: Any) -> None:
    """This process is a PD prefill role: the driver built next gets a link."""
    global _pending
    _pending = (channel, ctx, cfg, ports)


__all__ = ["PrefillLink", "attach", "expect"]
