"""Drives one rank's real SGLang 0.5.23 cache stack the way a PD-prefill scheduler does,
one prefill batch per step.

Per step (``Scheduler.get_next_batch_to_run`` -> ``_get_new_batch_prefill_raw`` ->
``prepare_for_extend`` -> forward -> ``process_batch_result_disagg_prefill``):

1. ``check_hicache_events`` (upstream's MIN all-reduce of ready acks, then the write and
   load acks);
2. a real ``PrefillAdder``: the chunked request's next chunk (``add_chunked_req``), then
   the waiting queue in order, each ``Req.init_next_round_input(tree_cache)``
   (``match_prefix``) then ``add_one_req`` (the temporary lock, the budget and sharded
   scratch checks, ``init_load_back`` on a host hit, the request's lock), stopping at the
   first request that does not fit, as upstream does;
3. ``ready_to_load_host_cache`` (starts the H2D copies; this rank's owned rows of every
   loaded page are poisoned first, so only a real copy passes the hit check);
4. SGLang's own ``alloc_for_extend`` on a ``ScheduleBatch`` (req slots,
   ``alloc_paged_token_slots_extend`` with its eviction and, sharded, the rotation bases,
   the ``req_to_token`` rows);
5. "forward" (``forward.py``): the hit's bytes checked on this rank's owned rows, the
   pattern KV and indexer bytes of the new tokens written into them; with per-layer D2H
   backup (the plugin column's default), ``Scheduler.run_batch``'s hook first reserves host
   slots for the batch's new leaves, and the forward stores layer by layer through the
   pool's own ``set_mla_kv_buffer`` (its store hook backs each layer up) inside
   ``ModelRunner.forward``'s hook (the forward's end), as ``layer_backup.py`` expects;
6. a middle chunk: ``checkpoint_kv_cache``; the last chunk: ``checkpoint_kv_cache``, then
   (the KV transfer done) ``release_kv_cache(checkpoint=True)`` and ``finish``; a
   retraction: ``release_kv_cache(checkpoint=False)``, the request re-queued.

Requests are real ``Req`` objects (``sim_req.py``). Only cache calls are timed, here (each
``self._op(name)`` block, ``engine.OpTimer``), with collectives counted;
checks, KV writes and the cross-rank agreement check run outside. All ranks make identical
calls, so the decision log (hashed per step) must agree.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sglang_cp_hicache.sim.collectives import CollectiveCounter
from sglang_cp_hicache.sim.config import SchedulerFeatures
from sglang_cp_hicache.sim.engine import (
    DecisionLog,
    FaultHooks,
    OpTimer,
    SimulationError,
    StepLoop,
    TreeSummary,
    Violations,
)
from sglang_cp_hicache.sim.pd import attach as attach_pd_link
from sglang_cp_hicache.sim.results import LaneUsage, RankCounters, RankResult, SeriesPoint
from sglang_cp_hicache.sim.v0_5_23.checks import (
    draft_bytes_per_token,
    poison_owned,
    rotation_problems,
    tree_summary,
)
from sglang_cp_hicache.sim.v0_5_23.forward import BatchForward
from sglang_cp_hicache.sim.v0_5_23.invariants import PoolLedger
from sglang_cp_hicache.sim.v0_5_23.observed_cache import CacheObserver
from sglang_cp_hicache.sim.v0_5_23.sim_req import RejectedKeys, SimReq
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack

#: ``--max-prefill-tokens``' default: the input tokens one prefill batch may carry.
MAX_PREFILL_TOKENS = 16384
_OUTPUT_TOKEN = 0  # the one token a PD prefill server generates (never cached)


class RankDriver(StepLoop):
    """The scheduler loop of one rank over its :class:`RankStack` (sharded or cp 1)."""

    def __init__(
        self,
        stack: RankStack,
        counter: CollectiveCounter,
        agree: Callable[[int], bool],
        hooks: FaultHooks,
        tree_digest_every: int,
        features: SchedulerFeatures,
        storage: Optional[Any] = None,
    ) -> None:
        self.stack = stack
        self.storage = storage  # sim.v0_5_23.storage.StorageTier: the L3 tier, if attached
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.req_pool = stack.req_to_token_pool
        self.rank = stack.shard_rank
        self.page_size = stack.config.page_size
        self.counter = counter
        self.agree = agree
        self.hooks = hooks
        self.tree_digest_every = tree_digest_every
        self.features = features
        self.chunk_size = features.chunked_prefill_size or None  # PrefillAdder's rem_chunk_tokens
        self._waiting: List[SimReq] = []  # deferred or re-queued, ahead of new requests
        self._chunked: Optional[SimReq] = None  # mid-prefill: its next chunk runs next step
        self._in_flight: List[tuple] = []  # (step, event hold) of the writes in flight
        host_pools = stack.host_pool_group.entry_map.values()  # KV anchor + DSA indexer
        # With the MTP draft its tail layers ride in the same host pools: counted apart.
        self.draft_bytes_per_token = draft_bytes_per_token(stack) if stack.draft_kv_pool is not None else 0
        self.bytes_per_token = sum(e.host_pool.size_per_token for e in host_pools) - self.draft_bytes_per_token

        self.counters = RankCounters()
        self.timer = OpTimer(counter)
        self._op = self.timer.op
        self._violation = Violations(self.rank)
        self.decisions = DecisionLog()
        self.series: List[SeriesPoint] = []
        self.step_index = 0
        self.rejected = RejectedKeys(self.page_size)
        in_flight = features.inflight_steps > 0
        self.ledger = PoolLedger(stack, self._violation, writes_in_flight=in_flight)
        self.host_peak_physical = 0
        self.host_peak_logical = 0
        self.lane_usage = LaneUsage.empty(stack.shard_size) if stack.sharded else None
        self.observer = CacheObserver(
            counters=self.counters,
            timed_op=self._op,
            allowed_collective=counter.in_writing_check_scope,
            before_load=lambda locs: poison_owned(stack, locs),
        )
        self.observer.attach(stack)
        self.forward = BatchForward(
            stack, features.per_layer_backup, self.observer, self.counters, self._violation, self._count_first_chunk,
            self.timer.untimed,
        )
        self.layer_ledger = self.forward.layer_ledger
        # SimConfig.pd: every finished prefill goes to the decode process (prefill roles only).
        self.pd = attach_pd_link(stack) if stack.sharded else None

    # ----------------------------------------------------------------- steps
    def run(self, steps: Sequence[Sequence[Request]], progress: Any = None) -> RankResult:
        return self._replay(steps, progress, SimReq)

    def _extra_eviction(self) -> None:
        """The ``diverge_last_rank`` fault's eviction (this rank only)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=self.page_size))

    def _waiting_rids(self) -> List[str]:
        chunked = [self._chunked] if self._chunked is not None else []
        return [r.rid for r in self._waiting + chunked]

    def _running(self) -> List[Any]:
        """Requests that hold a row between steps (the chunked one)."""
        return [self._chunked.req] if self._chunked is not None else []

    def _step(self, new_reqs: List[SimReq]) -> List[tuple]:
        self._land_writes(keep=self.features.inflight_steps)
        with self._op("check_events"):
            self.cache.check_hicache_events()
        self.ledger.check_idle(self._running())
        if self.layer_ledger is not None:
            self.layer_ledger.check_between_batches(writes_in_flight=self.features.inflight_steps > 0)
        if self.storage is not None:
            # Arrivals' L3 prefetches, then storage I/O runs to its end (sim/v0_5_23/storage.py).
            self.storage.arrive(new_reqs, self._op)
            self.storage.settle()
        records: List[tuple] = []
        batch, loads = self._admit(new_reqs, records)
        if not (batch or new_reqs or self._in_flight or self.cache.ongoing_write_through):
            # An idle pool with requests left: every later step would be this one.
            raise SimulationError(
                f"requests {self._waiting_rids()} cannot be admitted on an idle pool (free "
                f"pages per owner lane {self.ledger.device_lane_free()}, evictable "
                f"{self.cache.evictable_size()})"
            )
        with self._op("load_back" if loads else None):
            self.cache.ready_to_load_host_cache()
        if batch:
            schedule_batch, alloc_record = self._alloc(batch)
            records.append(alloc_record)
            # Opened before the forward: per-layer backups are submitted during it.
            hold = device_module().hold_events() if self.features.inflight_steps else None
            try:
                self.forward.run_batch(schedule_batch, batch)
                records += [self._finish(sreq) for sreq in batch]
            finally:
                if hold is not None:
                    hold.seal()  # this step's writes stay in flight, later events do not
                    self._in_flight.append((self.step_index, hold))
        self.timer.end_step()
        self._sample_host_usage()
        records.append(self._state_record())
        return records

    # ------------------------------------------------------------- admission
    def _admit(self, new_reqs: List[SimReq], records: List[tuple]) -> Tuple[List[SimReq], int]:
        """``_get_new_batch_prefill_raw`` on a PD prefill worker with no decode batch."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        by_req: Dict[int, SimReq] = {}
        with self._op(None):
            adder = PrefillAdder(
                self.page_size,
                self.cache,
                self.allocator,
                ScheduleBatch(reqs=[], batch_is_full=False),  # no running decode batch
                0.0,  # new_token_ratio: no decode to reserve for
                MAX_PREFILL_TOKENS,
                self.chunk_size,
            )
        if self._chunked is not None:
            chunked, by_req[id(self._chunked.req)] = self._chunked, self._chunked
            chunked.req.init_next_round_input()  # no tree: its prefix is its own KV
            with self._op(None):
                still = self._guard(lambda: adder.add_chunked_req(chunked.req))
            self._chunked = chunked if still is not None else None
            if not adder.can_run_list:
                records.append(("chunk_waits", chunked.rid))
        waiting, self._waiting = self._waiting + new_reqs, []
        loads, stop = 0, False
        for sreq in waiting:
            if stop or adder.budget_state() == AddReqResult.OTHER or not self._slot_for(adder):
                stop = True
                self._waiting.append(sreq)
                continue
            if self.storage is not None:
                self.storage.before_match(sreq, self._op)
            self._match(sreq)
            if self.storage is not None:
                self.storage.after_match(sreq, self._op, lambda: self._match(sreq))
            req = sreq.req
            with self._op(None):
                has_chunked = self._chunked is not None
                result = self._guard(
                    lambda: adder.add_one_req(req, has_chunked_req=has_chunked, truncation_align_size=None)
                )
            admitted = bool(adder.can_run_list) and adder.can_run_list[-1] is req
            stop = result != AddReqResult.CONTINUE
            if not admitted:
                self._waiting.append(sreq)
                records.append(("waits", sreq.rid, str(result)))
                continue
            by_req[id(req)] = sreq
            loads += int(req.host_loaded_length > 0)
            abort = self.features.draw("abort", sreq.request.index, sreq.attempt)
            if abort < self.features.abort_prob:
                self._abort(adder, sreq)
                records.append(("aborted", sreq.rid))
        if adder.new_chunked_req is not None:
            if self._chunked is not None:
                raise SimulationError("a second chunked request was admitted while one is running")
            self._chunked = by_req[id(adder.new_chunked_req)]
        return [by_req[id(req)] for req in adder.can_run_list], loads

    def _guard(self, call: Callable[[], Any]) -> Any:
        """An admission call; SGLang's refusals (e.g. a request that cannot fit the sharded
        scratch even in an empty batch) stop the run on every rank alike."""
        try:
            return call()
        except RuntimeError as exc:
            raise SimulationError(f"admission refused: {str(exc).splitlines()[0]}") from None

    def _slot_for(self, adder: Any) -> bool:
        """Upstream's running-request limit: one more request needs a free req slot."""
        new_rows = sum(1 for req in adder.can_run_list if not req.kv.holds_kv)
        return new_rows < self.req_pool.available_size()

    def _match(self, sreq: SimReq) -> None:
        """``Req.init_next_round_input(tree_cache)``: refreshes the fill ids and matches
        ``input[:-1]`` (SGLang's max prefix), recording the hit of the first chunk."""
        with self._op("match_prefix"):
            sreq.req.init_next_round_input(self.cache)
        sreq.device_hit = sreq.req.prefix_len
        sreq.host_hit = sreq.req.host_hit_length

    def _abort(self, adder: Any, sreq: SimReq) -> None:
        """Aborted after admission, before its forward: its lock released, its row never
        allocated (its load-back, if any, still lands into the tree)."""
        req = sreq.req
        adder.can_run_list.remove(req)
        if adder.new_chunked_req is req:
            adder.new_chunked_req = None
        with self._op(None):
            self.cache.unlock(req.lock)
        req.lock = None
        self.counters.aborted_requests += 1

    # ------------------------------------------------------------ allocation
    def _alloc(self, batch: List[SimReq]) -> Tuple[Any, tuple]:
        """SGLang's ``alloc_for_extend`` on a ``ScheduleBatch`` with the fields
        ``prepare_for_extend`` sets before it; the batch and the decision record."""
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.allocation import alloc_for_extend
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        reqs = [sreq.req for sreq in batch]
        schedule_batch = ScheduleBatch(
            reqs=reqs,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.cache,
            model_config=SimpleNamespace(is_encoder_decoder=False),
            device="cpu",
        )
        schedule_batch.forward_mode = ForwardMode.EXTEND
        schedule_batch.prefix_lens = [req.prefix_len for req in reqs]
        schedule_batch.extend_lens = [req.extend_len for req in reqs]
        seq_lens = [req.extend_end for req in reqs]
        schedule_batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
        schedule_batch.seq_lens = schedule_batch.seq_lens_cpu.clone()
        schedule_batch.extend_num_tokens = sum(schedule_batch.extend_lens)
        available_before = self.allocator.available_size()
        with self._op("alloc"):
            try:
                alloc_for_extend(schedule_batch)
            except RuntimeError as exc:  # SGLang's "Prefill out of memory" / no req slots
                raise SimulationError(
                    f"prefill out of memory (prefix lens {schedule_batch.prefix_lens}, extend lens "
                    f"{schedule_batch.extend_lens}, free pages per owner lane "
                    f"{self.ledger.device_lane_free()}, evictable {self.cache.evictable_size()}): "
                    f"{str(exc).splitlines()[0]}"
                ) from None
        return schedule_batch, ("alloc", available_before, self.allocator.available_size())

    # --------------------------------------------------------------- forward
    def _count_first_chunk(self, sreq: SimReq, mismatches: int, checked: int) -> None:
        sreq.started = True
        loaded = sreq.req.host_loaded_length
        c = self.counters
        c.count_first_chunk(len(sreq.prompt), sreq.device_hit, sreq.host_hit, loaded, mismatches, checked)
        if self.storage is not None:
            c.storage_hit_tokens += self.storage.hit_tokens(sreq)
        offered = sreq.device_hit + sreq.host_hit
        c.rejected_insert_hit_tokens += max(0, self.rejected.potential_match(sreq.prompt) - offered)

    def _finish(self, sreq: SimReq) -> tuple:
        """After the forward: a retraction, a middle chunk's checkpoint, or the last
        chunk's checkpoint then (KV sent) ``release_kv_cache`` and ``finish``."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        req = sreq.req
        draw = self.features.draw(f"retract@{req.extend_end}", sreq.request.index, sreq.attempt)
        retract = draw < self.features.retract_prob
        last = sreq.last_chunk
        if self.pd is not None and last and not retract:
            # As the PD prefill server: the KV goes to decode before the cache takes it back
            # (not timed: upstream's transfer and its CP poll are not cache calls).
            self.pd.transfer(sreq.rid, sreq.prompt, req.kv.req_pool_idx)
        with self._op("insert"):
            if retract:
                release_kv_cache(req, self.cache, checkpoint=False)
            elif not last:
                checkpoint_kv_cache(req, self.cache)
            else:
                req.output_ids.append(_OUTPUT_TOKEN)
                checkpoint_kv_cache(req, self.cache)
                req.finished_reason = FINISH_LENGTH(length=0)
                release_kv_cache(req, self.cache, checkpoint=True)
                self.cache.finish(req.cache_request_handle, CacheRequestOutcome.SUCCESS)
        rejected = self._take_rejected()
        if retract:
            self.counters.retracted_requests += 1
            if self._chunked is sreq:
                self._chunked = None
            self._waiting.append(SimReq(sreq.request, attempt=sreq.attempt + 1))
        elif not last:
            self.counters.prefill_chunks += 1
        return (
            sreq.rid, req.extend_end, sreq.device_hit, sreq.host_hit, req.host_loaded_length,
            req.kv.cache_protected_len, retract, rejected,
        )  # fmt: skip

    def _take_rejected(self) -> int:
        """The request's declined inserts (its checkpoints insert the same key again):
        counted once, at the largest, and remembered to price later misses."""
        declined = self.observer.take_declined()
        if not declined:
            return 0
        worst = max(declined, key=lambda d: d.rejected_tokens)
        self.rejected.add(worst)
        self.counters.rejected_inserts += 1
        self.counters.rejected_insert_tokens += worst.rejected_tokens
        return worst.rejected_tokens

    # -------------------------------------------------------- invariants / log
    def _state_record(self) -> tuple:
        """Replicated state after a step; a full tree digest every few steps."""
        record = (
            "state",
            tuple(self.ledger.device_lane_free()),
            tuple(self.ledger.host_lane_free()),
            self.cache.evictable_size(),
            self.cache.protected_size(),
            len(self.cache.ongoing_write_through),
            len(self.cache.ongoing_load_back),
            self.counters.device_evicted_tokens,
            self.counters.host_evicted_tokens,
        )
        if self.step_index % self.tree_digest_every == 0:
            summary = self._check_tree()
            record += (summary.digest,)
        return record

    def _tree_summary(self) -> TreeSummary:
        return tree_summary(self.cache)

    def _check_tree(self) -> TreeSummary:
        summary = tree_summary(self.cache)
        if not self._writes_in_flight():
            self.ledger.check_tree(summary)
        if self.stack.sharded:
            for problem in rotation_problems(self.cache, self.stack.shard_size, self.page_size):
                self._violation(problem)
        return summary

    def _writes_in_flight(self) -> bool:
        """Backups submitted but not acked hold host slots the tree does not show yet."""
        return bool(self.cache.ongoing_write_through)

    def _finish_run(self, stopped: Optional[str]) -> RankResult:
        if self.storage is not None and stopped is None:
            # The last backups reach L3 before the flush (their host copies are locked).
            with self._op(None):
                self.cache.check_hicache_events()
            self.storage.settle()
        summary, leaks = self._final_checks(stopped)
        if self.layer_ledger is not None and stopped is None:
            self.layer_ledger.check_between_batches(writes_in_flight=False)
        pd = None if self.pd is None else self.pd.stats
        storage = None if self.storage is None else self.storage.stats()
        draft_bpt = self.draft_bytes_per_token
        draft = dict(
            draft_bytes_per_token=draft_bpt,
            draft_d2h_bytes=self.observer.d2h_tokens * draft_bpt,
            draft_h2d_bytes=self.observer.h2d_tokens * draft_bpt,
            draft_host_peak_bytes=self.host_peak_physical // max(1, self.bytes_per_token) * draft_bpt,
        )
        return self._rank_result(stopped, summary, leaks, self.stack.sharded, pd=pd, storage=storage, **draft)
