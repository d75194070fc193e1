"""The 0.5.12.post1 line's PD roles for the simulator (``SimConfig.pd``; see ``sim/pd.py``).

A prefill role is one rank of the main column, exactly as ``rank.cp_rank_main`` runs it,
with a :class:`~sglang_cp_hicache.sim.v0_5_12.pd_link.PrefillLink` attached to its driver.
The decode role is the harness's ``DecodeServer`` (a full cp-1 pool under upstream's decode
queues), checking every token's KV, indexer K/scale and draft KV against the pattern.
"""

from __future__ import annotations

from typing import Any, List

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.pd import LinePD, serve_relayed
from sglang_cp_hicache.sim.results import PDDecodeStats, RankResult
from sglang_cp_hicache.sim.v0_5_12 import pd_link
from sglang_cp_hicache.sim.workload import Request

MISSING = ""  # this line has PD roles
_PD_FAULTS = {"pd_wrong_owner": "wrong_owner"}  # SimConfig.fault -> the harness's plant


def prefill_role(
    channel: Any, rank: int, cfg: SimConfig, steps: List[List[Request]], ports: Any, shard_impl: str
) -> RankResult:
    """Role: rank ``rank`` of the main column (``rank.cp_rank_main``) with its transfers."""
    from sglang_cp_hicache.sim.v0_5_12.rank import cp_rank_main
    from sglang_cp_hicache.testing.dist import init_rank_groups
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.context import install_parallel_state
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import plant_bug

    ctx = init_rank_groups(rank, cfg.cp_size, ports.gloo, timeout_s=cfg.timeout_s)
    install_parallel_state(cfg.cp_size, rank)  # what upstream's PD managers read
    plant_bug(_PD_FAULTS.get(cfg.fault), rank, cfg.cp_size)
    pd_link.expect(channel, ctx, cfg, ports)  # the driver attaches it to the stack it runs
    return cp_rank_main(ctx, cfg, steps, shard_impl)


def decode_role(channel: Any, cfg: SimConfig, ports: Any, decode_pages: int) -> PDDecodeStats:
    """Role: the decode server; receives and checks each relayed request, then releases
    it, until the harness sends None; the stats cover every request."""
    from sglang_cp_hicache.testing.pd.steps import load_plugins
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.context import install_parallel_state
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.decode import DecodeServer
    from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import PDScenario

    load_plugins()  # installed beside SGLang on the decode server too (flag off)
    install_parallel_state(1, 0)
    scenario = PDScenario(
        cp_size=1, steps=(), draft=cfg.draft, layer_num=cfg.layer_num,
        decode_pages=decode_pages, seed=cfg.seed,
    )  # fmt: skip
    with scheduler_batch.cpu_scheduler_server_args(cfg.page_size):
        server = DecodeServer(scenario, ports)
        return serve_relayed(channel, cfg.timeout_s, server, server.stack.allocator.available_size)


PD = LinePD(prefill_role=prefill_role, decode_role=decode_role)

__all__ = ["MISSING", "PD", "decode_role", "prefill_role"]
