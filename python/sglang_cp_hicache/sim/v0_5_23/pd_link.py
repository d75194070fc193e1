"""One 0.5.23 prefill rank's link to the decode process in the simulator (``SimConfig.pd``).

The link (``sim.pd.PrefillLink``) is the harness's ``PrefillRank`` (upstream's
``PrefillBootstrapQueue``, whose ``MooncakeKVManager`` reads the shard rank and size from the
stack's shard group; ``_send_kv_chunk``, upstream's own owner filter
``filter_kv_indices_for_shard_rank``; the CP-all-reduced poll) over the driver's own sharded
stack, so the pages sent are the ones the trace left, at their physical rows. The PD prefill
role (``sim/v0_5_23/pd.py``) announces the link with :func:`expect` before the rank body
builds its stack; the driver takes it with :func:`attach` (None in every other process).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed

from sglang_cp_hicache.sim import pd as sim_pd
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.pd import PrefillLink


def pd_scenario(cfg: SimConfig, context_len: int, decode_pages: int = 96) -> Any:
    """The harness scenario of a simulator run: its geometry, no steps of its own. With
    ``cfg.draft`` the prefill ranks send the stack's own MTP draft pool beside the target
    (upstream's ``num_draft_entries``) and the decode checks it too."""
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import PDScenario

    return PDScenario(
        cp_size=cfg.cp_size, steps=(), draft=cfg.draft, layer_num=cfg.layer_num,
        decode_pages=decode_pages, seed=cfg.seed, context_len=context_len,
    )  # fmt: skip


def open_link(channel: Any, ctx: Any, cfg: SimConfig, ports: Any, stack: Any) -> PrefillLink:
    """The harness's ``PrefillRank`` over ``stack`` (sharded, the plugin's flag on its
    record or not), once every rank registered with the bootstrap server."""
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.prefill import PrefillRank

    scenario = pd_scenario(cfg, stack.config.context_len)
    server = PrefillRank(ctx, scenario, ports, stack=stack)
    if cfg.fault == "pd_drop_draft":
        drop_draft_blocks(server.kv_manager, server.draft_pool)
    torch.distributed.barrier(group=ctx.cp_group)
    return PrefillLink(channel, ctx.rank, server, cfg.page_size, stack.owned_mask)


def drop_draft_blocks(kv_manager: Any, draft_pool: Any) -> None:
    """Planted ``pd_drop_draft``: this rank's engine never gets the transfer blocks read
    from the MTP draft pool's buffers (KV and indexer), the target's still go, and the send
    reports Success: only decode's draft check can tell."""
    buffers = (*draft_pool.kv_buffer, *draft_pool.index_k_with_scale_buffer)
    spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers]
    transfer = kv_manager._transfer_data

    def target_only(session_id: str, blocks: Any) -> int:
        kept = [blk for blk in blocks if not any(lo <= blk[0] < hi for lo, hi in spans)]
        return transfer(session_id, kept)

    kv_manager._transfer_data = target_only


def expect(channel: Any, ctx: Any, cfg: SimConfig, ports: Any) -> None:
    """This process is a PD prefill role: the driver built next gets a link."""
    sim_pd.expect(functools.partial(open_link, channel, ctx, cfg, ports))


__all__ = ["drop_draft_blocks", "expect", "open_link", "pd_scenario"]
