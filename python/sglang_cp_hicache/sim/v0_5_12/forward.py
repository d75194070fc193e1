"""The model's part of one 0.5.12.post1 simulator step: what a forward does with an admitted
batch on one rank. On a request's first chunk its hit is verified on the owned slots
(target and MTP draft bytes), then the new tokens' pattern KV goes into owned slots; the NSA
hooks' notifications follow (each layer's end, then the forward's end; with the draft, the
same for the draft forward, which SGLang runs after the target's). No cache call is made
here: the driver times those."""

from __future__ import annotations

from typing import List

import torch

from sglang_cp_hicache.sim.engine import Violations
from sglang_cp_hicache.sim.results import RankCounters
from sglang_cp_hicache.sim.v0_5_12.checks import verify_hit
from sglang_cp_hicache.sim.v0_5_12.sim_req import SimReq
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import RankStack, write_prefill_kv
from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup


class BatchForward:
    """One rank's forward of each admitted batch over its :class:`RankStack`; a request's
    first chunk is counted in ``counters`` (its hit and its check)."""

    def __init__(self, stack: RankStack, counters: RankCounters, violation: Violations) -> None:
        self.stack = stack
        self.counters = counters
        self._violation = violation

    def run(self, reqs: List[SimReq], out_cache_loc: torch.Tensor) -> None:
        """What the model does with the batch: read the hit, write the new tokens' KV."""
        offset = 0
        for req in reqs:
            tokens = torch.tensor(req.token_ids, dtype=torch.int64)
            prefix_len, seq_len = len(req.prefix_indices), len(tokens)
            new_locs = out_cache_loc[offset : offset + seq_len - prefix_len]
            offset += seq_len - prefix_len
            mismatches, checked = 0, 0
            draft_mismatches, draft_checked = 0, 0
            if not req.started:
                mismatches, checked = verify_hit(self.stack, req.prefix_indices, tokens[:prefix_len])
                if self.stack.draft_pool is not None:
                    # Every hit checks the draft's bytes too: a target hit with lost draft
                    # KV is a mismatch, never a good hit.
                    draft_mismatches, draft_checked = verify_hit(
                        self.stack, req.prefix_indices, tokens[:prefix_len], draft=True
                    )
            if mismatches:
                self._violation(
                    f"request {req.request.index}: {mismatches} of {checked} owned hit tokens "
                    f"have wrong KV/indexer bytes"
                )
            if draft_mismatches:
                self._violation(
                    f"request {req.request.index}: {draft_mismatches} of {draft_checked} owned "
                    f"hit tokens have wrong draft KV/indexer bytes"
                )
            new_positions = torch.arange(prefix_len, seq_len)
            write_prefill_kv(self.stack, new_locs, tokens[prefix_len:], new_positions)
            if req.started:
                continue  # a later chunk: its prefix is this request's own KV, not a hit
            req.started = True
            self._count_first_chunk(req, mismatches, checked, draft_mismatches, draft_checked)
        self._report_layers()

    def _count_first_chunk(
        self, req: SimReq, mismatches: int, checked: int, draft_mismatches: int, draft_checked: int
    ) -> None:
        c = self.counters
        c.count_first_chunk(len(req.prompt), req.device_hit, req.host_hit_length, req.loaded, mismatches, checked)
        c.draft_kv_mismatches += draft_mismatches
        c.draft_kv_checked_tokens += draft_checked

    def _report_layers(self) -> None:
        """The NSA hooks' notifications of one forward: each layer's end (its KV and index K
        stored; here all were written above), then the forward's end; with the MTP draft,
        the same for the draft forward, which SGLang runs after the target's."""
        for pool in (self.stack.kv_pool, self.stack.draft_pool):
            if pool is None:
                continue
            for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
                cp_layer_backup.notify_layer_stored(pool, layer)
            cp_layer_backup.notify_forward_end(pool)


__all__ = ["BatchForward"]
