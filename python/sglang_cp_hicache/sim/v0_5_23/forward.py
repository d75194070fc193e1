"""The model's part of one 0.5.23 simulator step: what a forward does with an admitted batch
on one rank (``Scheduler.run_batch`` -> ``ModelRunner.forward``).

The hit's bytes are checked on this rank's owned rows (target and MTP draft) on a request's
first chunk, then the new tokens' pattern KV and indexer bytes are written into them
(``checks.py``). With per-layer D2H backup (the plugin column's default) the forward runs
through the plugin's hooks as a scheduler runs them: ``run_batch``'s reserves host slots for
the batch's new leaves, the forward stores layer by layer through the pool's own
``set_mla_kv_buffer`` (its store hook backs each layer up) inside ``ModelRunner.forward``'s
(the forward's end), then the EAGLE draft's forward the same way. No cache call is made
here: the driver times those.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, List, Optional, Tuple

import torch

from sglang_cp_hicache.sim.engine import SimulationError, Violations
from sglang_cp_hicache.sim.results import RankCounters
from sglang_cp_hicache.sim.v0_5_23.checks import (
    store_draft_layer,
    store_prefill_layer,
    verify_draft_hit,
    verify_hit,
    write_draft_kv,
    write_prefill_kv,
)
from sglang_cp_hicache.sim.v0_5_23.invariants import LayerBackupLedger
from sglang_cp_hicache.sim.v0_5_23.observed_cache import CacheObserver
from sglang_cp_hicache.sim.v0_5_23.sim_req import SimReq
from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import fresh_write_plan
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack

#: A batch's new KV: (logical locs, token ids, positions) of its new tokens, in batch order.
NewKV = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BatchForward:
    """One rank's forward of each admitted batch over its :class:`RankStack`.

    ``on_first_chunk(sreq, mismatches, checked)`` is told each request's hit check, once,
    on its first chunk (the driver counts it). The per-layer backup, when the column runs
    it, is observed by ``observer`` and checked by :attr:`layer_ledger`.
    """

    def __init__(
        self,
        stack: RankStack,
        per_layer_backup: bool,
        observer: CacheObserver,
        counters: RankCounters,
        violation: Violations,
        on_first_chunk: Callable[[SimReq, int, int], None],
        untimed: Callable[[], ContextManager],
    ) -> None:
        self.stack = stack
        self.counters = counters
        self._violation = violation
        self._on_first_chunk = on_first_chunk
        self._untimed = untimed  # the ledger's records are no scheduler operation's time
        self.layer_backup, self.layer_ledger = self._attach_layer_backup(per_layer_backup, observer)
        layer_num = stack.config.layer_num if self.layer_backup is not None else 0
        self.attention_layers = _attention_layers(stack, layer_num)
        self.draft_attention_layers = _attention_layers(stack, stack.config.draft_layer_num)

    def _attach_layer_backup(
        self, per_layer: bool, observer: CacheObserver
    ) -> Tuple[Any, Optional[LayerBackupLedger]]:
        """The stack's per-layer D2H backup when the column runs it (the plugin's flag
        attaches it at ``init_hicache`` on either host layout, or the stack's start-up
        failed with ``PerLayerBackupUnavailable``), observed and checked;
        (None, None) for upstream's all-layer path."""
        from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

        if not per_layer:
            return None, None
        backup = layer_backup_of(self.stack.cache)
        if backup is None:
            raise SimulationError("per_layer_backup: the stack has no per-layer D2H backup attached")
        observer.attach_layer_backup(backup, self.stack)
        return backup, LayerBackupLedger(backup, self.stack, self.counters, self._violation, self._untimed)

    def run_batch(self, schedule_batch: Any, batch: List[SimReq]) -> None:
        """``Scheduler.run_batch``. With per-layer backup, through the plugin's hooks as a
        scheduler runs them: ``run_batch``'s reserves host slots for the batch's new leaves
        (``reserve_batch``), then the model forward inside ``ModelRunner.forward``'s (the
        forward's end); only what they read of the scheduler and the model runner is
        stood in. A forward the backup refuses (a layer skipped) stops every rank."""
        if self.layer_backup is None:
            self._forward(batch)
            return
        from types import SimpleNamespace

        from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete
        from sglang_cp_hicache.v0_5_23.backup.layer_backup import model_forward_around, run_batch_around

        runner = SimpleNamespace(token_to_kv_pool=self.stack.kv_pool)  # the pool is the runner's
        new_kv: List[NewKV] = []

        def model_forward(runner: Any, fb: Any) -> None:
            new_kv.append(self._forward(batch))

        def draft_forward(runner: Any, fb: Any) -> None:
            fresh_write_plan(self.stack.draft_kv_pool)  # the draft pool caches its own plan
            for layer in self.draft_attention_layers:
                store_draft_layer(self.stack, layer, *new_kv[0])

        def upstream_run_batch(scheduler: Any, sb: Any) -> None:
            with self.layer_ledger.forward():
                model_forward_around(model_forward, runner, None)
                if self.stack.draft_kv_pool is not None:  # the EAGLE draft's extend, after the target's
                    draft_runner = SimpleNamespace(token_to_kv_pool=self.stack.draft_kv_pool)
                    model_forward_around(draft_forward, draft_runner, None)

        try:
            run_batch_around(upstream_run_batch, SimpleNamespace(tree_cache=self.stack.cache), schedule_batch)
        except PerLayerBackupIncomplete as exc:
            raise SimulationError(f"per-layer backup refused the forward: {exc}") from None

    def _forward(self, batch: List[SimReq]) -> NewKV:
        """What the model does with the batch: read the hit (target and MTP draft bytes),
        write the new tokens' KV (with per-layer backup, layer by layer over the whole batch
        through the pool; the draft's layer is then the draft forward's, in
        :meth:`run_batch`). Returns the batch's new (locs, tokens, positions)."""
        rows = self.stack.req_to_token_pool.req_to_token
        new_kv: List[NewKV] = []
        for sreq in batch:
            req = sreq.req
            locs = rows[req.kv.req_pool_idx, : req.extend_end].to(torch.int64)
            tokens = torch.tensor(sreq.prompt[: req.extend_end], dtype=torch.int64)
            prefix_len = req.prefix_len
            if not sreq.started:
                mismatches, checked = verify_hit(self.stack, locs[:prefix_len], tokens[:prefix_len])
                if mismatches:
                    self._violation(
                        f"request {sreq.request.index}: {mismatches} of {checked} owned hit "
                        "tokens have wrong KV/indexer bytes"
                    )
                self._on_first_chunk(sreq, mismatches, checked)
                if self.stack.draft_kv_pool is not None:
                    self._check_draft_hit(sreq, locs[:prefix_len], tokens[:prefix_len])
            positions = torch.arange(prefix_len, req.extend_end)
            new_kv.append((locs[prefix_len:], tokens[prefix_len:], positions))
        batch_kv = tuple(torch.cat(parts) for parts in zip(*new_kv))
        if self.layer_backup is None:
            for locs, tokens, positions in new_kv:
                write_prefill_kv(self.stack, locs, tokens, positions)
                if self.stack.draft_kv_pool is not None:
                    write_draft_kv(self.stack, locs, tokens, positions)
            return batch_kv
        fresh_write_plan(self.stack.kv_pool)  # what begin_shard_extend does to the pool's plan
        for layer in self.attention_layers:
            store_prefill_layer(self.stack, layer, *batch_kv)
        return batch_kv

    def _check_draft_hit(self, sreq: SimReq, hit_locs: torch.Tensor, hit_tokens: torch.Tensor) -> None:
        """Every hit checks the MTP draft's bytes too: a target hit whose draft bytes were
        lost (not backed up, not loaded back) is a draft mismatch, never a good hit."""
        mismatches, checked = verify_draft_hit(self.stack, hit_locs, hit_tokens)
        if mismatches:
            self._violation(
                f"request {sreq.request.index}: {mismatches} of {checked} owned hit tokens "
                "have wrong MTP draft KV/indexer bytes"
            )
        self.counters.draft_kv_mismatches += mismatches
        self.counters.draft_kv_checked_tokens += checked


def _attention_layers(stack: RankStack, layer_num: int) -> List[Any]:
    """``layer_num`` attention layers (layer ids from 0), as a pool's store door takes them."""
    from sglang.srt.layers.radix_attention import RadixAttention

    dim = stack.config.kv_cache_dim
    return [
        RadixAttention(num_heads=1, head_dim=dim, scaling=1.0, num_kv_heads=1, layer_id=layer_id)
        for layer_id in range(layer_num)
    ]


__all__ = ["BatchForward", "NewKV"]
