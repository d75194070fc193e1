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
from sglang_cp_hicache.sim.pd import PrefillLink, attach


def pd_scenario(cfg: SimConfig, context_len: int, decode_pages: int = 96) -> Any:
    """The harness scenario of a simulator run: its geometry, no steps of its own. The MTP
    draft's pool is not sent on this line's simulator yet: refused, never left unchecked."""
    from sglang_cp_hicache.testing.v0_5_23 import pd_harness

    if cfg.draft:
        raise ValueError("pd=True with draft=True: the 0.5.23 simulator's PD roles send no MTP draft pool yet")

    return pd_harness.PDScenario(
        cp_size=cfg.cp_size, steps=(), layer_num=cfg.layer_num, decode_pages=decode_pages,
        seed=cfg.seed, context_len=context_len,
    )  # fmt: skip


def open_link(channel: Any, ctx: Any, cfg: SimConfig, ports: Any, stack: Any) -> PrefillLink:
    """The harness's ``PrefillRank`` over ``stack`` (sharded, the plugin's flag on its
    record or not), once every rank registered with the bootstrap server."""
    from sglang_cp_hicache.testing.v0_5_23 import pd_harness

    scenario = pd_scenario(cfg, stack.config.context_len)
    server = pd_harness.PrefillRank(ctx, scenario, ports, stack=stack)
    torch.distributed.barrier(group=ctx.cp_group)
    return PrefillLink(channel, ctx.rank, server, cfg.page_size, stack.owned_mask)


def expect(channel: Any, ctx: Any, cfg: SimConfig, ports: Any) -> None:
    """This process is a PD prefill role: the driver built next gets a link."""
    sim_pd.expect(functools.partial(open_link, channel, ctx, cfg, ports))


__all__ = ["PrefillLink", "attach", "expect", "open_link", "pd_scenario"]
