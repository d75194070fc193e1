"""One 0.5.12.post1 prefill rank's link to the decode process in the simulator (``SimConfig.pd``).

The link (``sim.pd.PrefillLink``) is the harness's ``PrefillRank`` (upstream's
``PrefillBootstrapQueue``, ``MooncakeKVManager``, ``send_kv_chunk``, the CP-all-reduced poll)
over the driver's own stack, so the pages sent are the ones the trace left, at their physical
ids. The PD prefill role (``sim/v0_5_12/pd.py``) announces the link with :func:`expect` before
the rank body builds its stack; the driver takes it with :func:`attach` (None in every other
process).
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.sim import pd as sim_pd
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.pd import PrefillLink


def open_link(channel: Any, ctx: Any, cfg: SimConfig, ports: Any, stack: Any) -> PrefillLink:
    """The harness's ``PrefillRank`` over ``stack`` (the plugin's CP shared-KV stack), once
    every rank registered with the bootstrap server."""
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.prefill import PrefillRank
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import PDScenario

    scenario = PDScenario(
        cp_size=cfg.cp_size, steps=(), draft=cfg.draft, layer_num=cfg.layer_num,
    )  # fmt: skip
    with scheduler_batch.cpu_scheduler_server_args(cfg.page_size):
        server = PrefillRank(ctx, scenario, ports, stack=stack)
    torch.distributed.barrier(group=ctx.cp_group)

    def owned(page_locs: torch.Tensor) -> torch.Tensor:
        return lane_of(page_locs.to(torch.int64) // cfg.page_size, cfg.cp_size) == ctx.rank

    return PrefillLink(channel, ctx.rank, server, cfg.page_size, owned)


def expect(channel: Any, ctx: Any, cfg: SimConfig, ports: Any) -> None:
    """This process is a PD prefill role: the driver built next gets a link."""
    sim_pd.expect(functools.partial(open_link, channel, ctx, cfg, ports))


__all__ = ["expect", "open_link"]
