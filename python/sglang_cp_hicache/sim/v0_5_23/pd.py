"""The 0.5.23 line's PD roles for the simulator (``SimConfig.pd``; see ``sim/pd.py``).

A prefill role is one shard rank of the main column (``plugin`` or ``native``), exactly as
``rank.sharded_rank_main`` runs it, with a :class:`~sglang_cp_hicache.sim.pd.PrefillLink`
attached to its driver (``sim/v0_5_23/pd_link.py``): every finished prefill goes through
upstream's own sharded PD send. The decode role is the harness's ``DecodeServer`` (a full
cp-1 ``DSATokenToKVPool`` under upstream's decode queues), checking every token's MLA KV and
DSA indexer K/scale (with ``draft``, the MTP draft's too, sent from each rank's own draft
pool) against :func:`sim_pattern`, what this line's simulated forward stores
(``sim/v0_5_23/checks.py``), and releasing each request once checked.
"""

from __future__ import annotations

import contextlib
from typing import Any, List

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.pd import LinePD, serve_relayed
from sglang_cp_hicache.sim.results import PDDecodeStats, RankResult
from sglang_cp_hicache.sim.v0_5_23 import pd_link
from sglang_cp_hicache.sim.workload import Request

MISSING = ""  # this line has PD roles
_PD_FAULTS = {"pd_wrong_owner": "wrong_owner"}  # SimConfig.fault -> the harness's plant


def sim_pattern(cfg: SimConfig) -> Any:
    """The harness's ``KVPattern`` of what the simulator's forward stores (``checks.py``):
    the draft's layer ``i`` is pattern layer ``layer_num + i`` (its host tail layer)."""
    from sglang_cp_hicache.sim.v0_5_23.checks import expected_index_bytes, expected_kv_rows
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import KVPattern

    return KVPattern(kv=expected_kv_rows, index=expected_index_bytes, draft_first_layer=cfg.layer_num)


def prefill_role(
    channel: Any, rank: int, cfg: SimConfig, steps: List[List[Request]], ports: Any, shard_impl: str
) -> RankResult:
    """Role: shard rank ``rank`` of the main column (``rank.sharded_rank_main``) with its
    transfers; ``pd_wrong_owner`` plants the harness's wrong owner in upstream's filter
    (``pd_drop_draft`` is planted on the link, ``pd_link.drop_draft_blocks``)."""
    from sglang_cp_hicache.sim.v0_5_23.rank import sharded_rank_main
    from sglang_cp_hicache.testing.dist import init_rank_groups
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import planted_filter

    ctx = init_rank_groups(rank, cfg.cp_size, ports.gloo, timeout_s=cfg.timeout_s)
    plant = _PD_FAULTS.get(cfg.fault)
    with planted_filter(plant, rank, cfg.cp_size) if plant else contextlib.nullcontext():
        pd_link.expect(channel, ctx, cfg, ports)  # the driver attaches it to the stack it runs
        return sharded_rank_main(ctx, cfg, steps, shard_impl)


def decode_role(channel: Any, cfg: SimConfig, ports: Any, decode_pages: int) -> PDDecodeStats:
    """Role: the decode server; receives and checks each relayed request, then releases
    it, until the harness sends None; the stats cover every request."""
    from sglang_cp_hicache.testing.pd.steps import load_plugins
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.decode import DecodeServer

    load_plugins()  # installed beside SGLang on the decode server too (flag off)
    # A request row as long as the whole pool: room for the longest prompt.
    scenario = pd_link.pd_scenario(cfg, decode_pages * cfg.page_size, decode_pages)
    server = DecodeServer(scenario, ports, pattern=sim_pattern(cfg))
    return serve_relayed(channel, cfg.timeout_s, server, server.allocator.available_size)


PD = LinePD(prefill_role=prefill_role, decode_role=decode_role)

__all__ = ["MISSING", "PD", "decode_role", "prefill_role", "sim_pattern"]
