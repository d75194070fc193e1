"""``--pd --draft`` on the 0.5.23 simulator, in one process: the line runs it (no refusal),
the decode's reference for the draft is what the simulator's draft forward stores, and the
planted ``pd_drop_draft`` drops exactly the draft pool's transfer blocks. The run itself
(ranks, Mooncake, decode) is ``multi_rank/v0_5_23/sim/test_simulator_pd.py``'s."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.v0_5_23.rank import LINE


def test_the_line_runs_pd_with_the_draft_and_plants_the_dropped_draft_send() -> None:
    LINE.check(SimConfig(pd=True, draft=True))
    LINE.check(SimConfig(pd=True, draft=True, fault="pd_drop_draft"))
    assert "pd_drop_draft" in LINE.faults
    with pytest.raises(ValueError, match="needs pd=True and draft=True"):
        SimConfig(pd=True, fault="pd_drop_draft")


def test_the_decode_reference_is_what_the_draft_forward_stores(gloo_world1) -> None:
    from sglang_cp_hicache.sim.v0_5_23.checks import write_draft_kv, write_prefill_kv
    from sglang_cp_hicache.sim.v0_5_23.pd import sim_pattern
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import count_kv_mismatches
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    cfg = SimConfig(pd=True, draft=True, layer_num=2)
    config = StackConfig(device_pages_per_rank=4, context_len=512, layer_num=2, mtp_draft=True)
    with build_unsharded_stack(gloo_world1, config) as stack:
        locs, tokens, positions = torch.arange(64, 164), torch.arange(1000, 1100), torch.arange(100)
        write_prefill_kv(stack, locs, tokens, positions)
        write_draft_kv(stack, locs, tokens, positions)
        pattern = sim_pattern(cfg)
        draft, first = stack.draft_kv_pool, pattern.draft_first_layer
        assert count_kv_mismatches(stack.kv_pool, locs, tokens, positions, pattern=pattern) == 0
        assert count_kv_mismatches(draft, locs, tokens, positions, first_layer=first, pattern=pattern) == 0
        # The target's bytes in the draft's rows (a send that paired the wrong pools) fail.
        assert count_kv_mismatches(draft, locs, tokens, positions, pattern=pattern) == 100


def test_the_planted_drop_keeps_target_blocks_and_drops_draft_blocks() -> None:
    from sglang_cp_hicache.sim.v0_5_23.pd_link import drop_draft_blocks

    target, draft_kv, draft_index = torch.zeros(256), torch.zeros(64), torch.zeros(32, dtype=torch.uint8)
    draft_pool = SimpleNamespace(kv_buffer=[draft_kv], index_k_with_scale_buffer=[draft_index])
    sent = []
    manager = SimpleNamespace(_transfer_data=lambda session, blocks: sent.append((session, blocks)) or 0)
    drop_draft_blocks(manager, draft_pool)
    blocks = [
        (target.data_ptr(), 1, 64),
        (draft_kv.data_ptr() + 8, 2, 16),
        (draft_index.data_ptr(), 3, 32),
        (target.data_ptr() + 512, 4, 64),
    ]
    assert manager._transfer_data("s", blocks) == 0
    assert sent == [("s", [blocks[0], blocks[3]])]
