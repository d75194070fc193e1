"""Drives one rank's cache exactly as SGLang's scheduler does, one prefill batch per step.

Per step (``Scheduler._get_new_batch_prefill_raw`` -> ``PrefillAdder`` ->
``alloc_for_extend`` -> forward -> ``cache_finished_req``):

1. ``check_hicache_events`` (write acks: the one allowed all-reduce; load acks);
2. per request: ``match_prefix``, ``PrefillAdder``'s checks (``admission.py``), then under
   a temporary lock ``init_load_back`` when the match ended on host, then the request's own
   lock on its last node;
3. ``ready_to_load_host_cache`` (starts the H2D copies);
4. SGLang's own ``alloc_for_extend`` (with the plugin's hooks around it in CP ranks): a
   req slot, ``alloc_paged_token_slots_extend`` (``evict_from_tree_cache`` +
   ``alloc_extend``), the ``req_to_token`` rows (and, under CP, their host mirror);
5. "forward" (``forward.py``): pattern KV for the new tokens into owned slots (with the MTP draft: its
   pattern into the draft pool too, its layer reported after the target forward's end);
   the hit is verified, target and draft bytes;
6. with ``SimConfig.pd``, a finished prefill goes to the decode process first (upstream's
   PD prefill path over this stack, ``pd_link.PrefillLink``);
7. ``release_kv_cache``: the cache's own ``cache_finished_req`` (insert the page-aligned
   key, free duplicates and the unaligned tail, unlock), then the req slot.

Requests are ``sim_req.SimReq``. Only the cache calls are timed, here (each
``self._op(name)`` block, ``engine.OpTimer``), with collectives counted; checks, KV writes and the
per-step cross-rank agreement check run outside. ``cache.evict`` is timed as ``evict``
wherever the scheduler path calls it, and that time is not counted twice in its caller.
All ranks make identical calls, so the decision log (hashed per step) must agree.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

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
from sglang_cp_hicache.sim.v0_5_12.admission import PrefillBudget
from sglang_cp_hicache.sim.v0_5_12.checks import poison_owned, tree_summary
from sglang_cp_hicache.sim.v0_5_12.forward import BatchForward
from sglang_cp_hicache.sim.v0_5_12.invariants import PoolLedger
from sglang_cp_hicache.sim.v0_5_12.observed_cache import CacheObserver
from sglang_cp_hicache.sim.v0_5_12.sim_req import SimReq
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import RankStack, device_run_mismatches


class RankDriver(StepLoop):
    def __init__(
        self,
        stack: RankStack,
        rank: int,
        shared_kv: bool,
        counter: CollectiveCounter,
        agree: Callable[[int], bool],
        hooks: FaultHooks,
        tree_digest_every: int,
        features: Optional[SchedulerFeatures] = None,
    ) -> None:
        self.stack = stack
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.req_pool = stack.req_to_token_pool
        self.controller = self.cache.cache_controller
        self.rank = rank
        self.shared_kv = shared_kv
        self.counter = counter
        self.agree = agree
        self.hooks = hooks
        self.tree_digest_every = tree_digest_every
        self.features = features or SchedulerFeatures()
        if shared_kv:
            self.cache.per_layer_backup = self.features.per_layer_backup
        self._waiting: List[SimReq] = []  # deferred or re-queued, ahead of new requests
        self._chunked: List[SimReq] = []  # mid-prefill: their next chunk runs next step
        self._in_flight: List[tuple] = []  # (step, event hold) of the writes in flight
        self.page_size = self.cache.page_size
        self.host_pool = self.controller.mem_pool_host
        self.bytes_per_token = sum(e.host_pool.size_per_token for e in self.host_pool.entries)
        draft_host = getattr(self.host_pool, "draft", None)  # the MTP draft's, same slots
        self.draft_bytes_per_token = (
            0 if draft_host is None else sum(e.host_pool.size_per_token for e in draft_host.entries)
        )
        self.draft_host_peak = 0

        self.counters = RankCounters()
        self.timer = OpTimer(counter)
        self._op = self.timer.op  # a cache call on the scheduler path (engine.OpTimer)
        self._violation = Violations(rank)
        self.series: List[SeriesPoint] = []
        self.decisions = DecisionLog()
        self.step_index = 0

        self.ledger = PoolLedger(
            stack, rank, shared_kv, self._violation, writes_in_flight=self.features.inflight_steps > 0
        )
        self.host_peak_physical = 0
        self.host_peak_logical = 0
        self.lane_usage = LaneUsage.empty(len(self.ledger.start_lanes)) if shared_kv else None
        self.budget = PrefillBudget(
            self.cache, self.allocator, self.req_pool, self.page_size, len(self.ledger.start_lanes or [1]),
            self.features.chunked_prefill_size,
        )  # fmt: skip
        self.forward = BatchForward(stack, self.counters, self._violation)
        self.observer = self._observe(counter)
        # SimConfig.pd: every finished prefill goes to the decode process (prefill roles only).
        self.pd = attach_pd_link(stack) if shared_kv else None

    # ------------------------------------------------------------- plumbing
    def _observe(self, counter: CollectiveCounter) -> CacheObserver:
        """Count evictions and transfers at the cache's own event seams, time ``evict``
        wherever the scheduler path calls it, mark the allowed all-reduce."""
        observer = CacheObserver(
            counters=self.counters,
            timed_op=self._op,
            allowed_collective=counter.in_writing_check_scope,
            physical_tokens=self.cache.owned_host_tokens,
        )
        self.cache.observer = observer
        return observer

    # ----------------------------------------------------------------- steps
    def run(self, steps: Sequence[Sequence[Request]], progress: Any = None) -> RankResult:
        with scheduler_batch.cpu_scheduler_server_args(self.page_size):
            return self._run(steps, progress)

    def _run(self, steps: Sequence[Sequence[Request]], progress: Any) -> RankResult:
        return self._replay(steps, progress, SimReq)

    def _extra_eviction(self) -> None:
        """The ``diverge_last_rank`` fault's eviction (this rank only)."""
        self.cache.evict(EvictParams(num_tokens=1))

    def _waiting_rids(self) -> List[str]:
        """Deferred, re-queued and mid-chunk requests: the drain runs until none is left."""
        return [r.rid for r in self._waiting + self._chunked]

    def _step(self, new_reqs: List[SimReq]) -> List[tuple]:
        self._land_writes(keep=self.features.inflight_steps)
        with self._op("check_events"):
            self.cache.check_hicache_events()
        self.ledger.check_idle(self._chunked)
        # get_new_batch_prefill: the chunked request first, then the waiting queue in order.
        reqs: List[SimReq] = []
        records: List[tuple] = []
        self._resume_chunked(reqs, records)
        waiting, self._waiting = self._waiting + new_reqs, []
        loads = 0
        for req in waiting:
            self._match(req)
            if self._deferred(req):
                self._waiting.append(req)
                self.counters.deferred_requests += 1
                records.append(("deferred", req.rid))
                continue
            fits = self.budget.fits(reqs, req, self._chunked)
            if not fits or self.budget.second_chunked(reqs, req, self._chunked):
                self._waiting.append(req)
                records.append(("no_room", req.rid))
                continue
            loads += self._admit(req)
            if self.features.draw("abort", req.request.index, req.attempt) < self.features.abort_prob:
                with self._op(None):
                    self.cache.dec_lock_ref(req.last_node)  # aborted before its forward
                self.counters.aborted_requests += 1
                records.append(("aborted", req.rid))
                continue
            reqs.append(req)
        with self._op("load_back" if loads else None):
            self.cache.ready_to_load_host_cache()
        if reqs:
            for req in reqs:
                self._next_chunk(req)
            out_cache_loc, alloc_record = self._alloc(reqs)
            self._reserve_before_forward(reqs)
            # Opened before the forward: per-layer backups are submitted during it.
            hold = device_module().hold_events() if self.features.inflight_steps else None
            try:
                self.forward.run(reqs, out_cache_loc)
                records += [self._finish(req) for req in reqs]
            finally:
                if hold is not None:
                    hold.seal()  # this step's writes stay in flight, later events do not
                    self._in_flight.append((self.step_index, hold))
            records.append(alloc_record)
        if self.shared_kv:
            # What the planners read for each device node must be its device locs.
            for problem in device_run_mismatches(self.cache):
                self._violation(problem)
        self.timer.end_step()
        self._sample_series()
        records.append(self._state_record())
        return records

    def _resume_chunked(self, reqs: List[SimReq], records: List[tuple]) -> None:
        """The chunked request goes first (no match: it holds its lock); with no room for
        its next chunk it waits, keeping its lock."""
        chunked, self._chunked = self._chunked, []
        for req in chunked:
            if self.budget.fits(reqs, req, self._chunked):
                reqs.append(req)
            else:
                self._chunked.append(req)
                records.append(("chunk_waits", req.rid))

    def _reserve_before_forward(self, reqs: List[SimReq]) -> None:
        """The plugin's ``ScheduleBatch.prepare_for_extend`` hook: host pages for the new
        leaves are reserved before the forward (timed with ``alloc``)."""
        reserve = getattr(self.cache, "reserve_for_extend", None)  # not on the baseline
        if reserve is None:
            return
        with self._op("alloc"):
            for req in reqs:
                reserve(req)

    def _deferred(self, req: SimReq) -> bool:
        """PrefillAdder (with the plugin's hook): the match stopped above a pending backup
        it would split, so the request waits for this round (it holds no lock)."""
        take = getattr(self.cache, "take_split_deferral", None)  # not on the baseline
        return take is not None and take(req)

    def _next_chunk(self, req: SimReq) -> None:
        req.fill_len = self.budget.chunk_end(req, len(req.prefix_indices))

    def _match(self, req: SimReq) -> None:
        key = RadixKey(list(req.prompt[: len(req.prompt) - 1]))  # SGLang: input_len - 1
        with self._op("match_prefix"):
            match = self.cache.match_prefix(MatchPrefixParams(key=key, req=req))
        req.prefix_indices = match.device_indices
        req.last_node = match.last_device_node
        req.best_match_node = match.best_match_node
        req.host_hit_length = match.host_hit_length
        req.device_hit = len(req.prefix_indices)

    def _admit(self, req: SimReq) -> int:
        """PrefillAdder.add_one_req: temporary lock, load-back, the request's lock."""
        admission_node = req.last_node
        with self._op(None):
            self.cache.inc_lock_ref(admission_node)
        if req.host_hit_length > 0:
            with self._op("load_back"):
                new_indices, req.last_node = self.cache.init_load_back(
                    InitLoadBackParams(
                        best_match_node=req.best_match_node, host_hit_length=req.host_hit_length
                    )
                )
            req.loaded = len(new_indices)
            if req.loaded:
                # The copy runs in ready_to_load_host_cache: only it can restore these bytes.
                poison_owned(self.stack, new_indices)
                req.prefix_indices = torch.cat([req.prefix_indices, new_indices])
        req.cache_protected_len = len(req.prefix_indices)
        with self._op(None):
            self.cache.inc_lock_ref(req.last_node)
            self.cache.dec_lock_ref(admission_node)
        return int(req.loaded > 0)

    def _alloc(self, reqs: List[SimReq]) -> tuple:
        """SGLang's own ``alloc_for_extend`` (req slots, paged extend allocation with its
        eviction, ``req_to_token`` rows; the plugin's hooks around it in CP ranks)."""
        seq_lens = [len(r.token_ids) for r in reqs]
        available_before = self.allocator.available_size()
        with self._op("alloc"):
            try:
                out_cache_loc = scheduler_batch.alloc_for_extend(self.stack, reqs, seq_lens)
            except RuntimeError as exc:  # SGLang's "Prefill out of memory" / out of req slots
                lanes = ""
                if self.shared_kv:
                    lanes = f", free pages per owner lane {self.ledger.lanes()}"
                raise SimulationError(
                    f"prefill out of memory (prefix lens {[len(r.prefix_indices) for r in reqs]}, "
                    f"seq lens {seq_lens}, available {self.allocator.available_size()}, "
                    f"evictable {self.cache.evictable_size()}{lanes}): "
                    f"{str(exc).splitlines()[0]}"
                ) from None
            for req, seq_len in zip(reqs, seq_lens):
                req.kv_committed_len = seq_len
        return out_cache_loc, ("alloc", available_before, self.allocator.available_size())

    def _finish(self, req: SimReq) -> tuple:
        """After the forward: retraction (KV freed uninserted, re-queued), the chunked
        request's cache_unfinished_req, or release_kv_cache (cache_finished_req)."""
        draw = self.features.draw(f"retract@{req.fill_len}", req.request.index, req.attempt)
        retract = draw < self.features.retract_prob
        if self.pd is not None and req.finished_prefill and not retract:
            # As the PD prefill server: the KV goes to decode before the cache takes it back
            # (not timed: upstream's transfer and its CP poll are not cache calls).
            self.pd.transfer(req.rid, req.prompt, req.req_pool_idx)
        with self._op("insert"):
            if retract:
                self.cache.cache_finished_req(req, is_insert=False)
                self.req_pool.free(req)
            elif not req.finished_prefill:
                self.cache.cache_unfinished_req(req, chunked=True)
            else:
                self.cache.cache_finished_req(req)
                self.req_pool.free(req)
        if retract:
            self.counters.retracted_requests += 1
            self._waiting.append(SimReq(req.request, attempt=req.attempt + 1))
        elif not req.finished_prefill:
            self.counters.prefill_chunks += 1
            self._chunked.append(req)
        return (
            req.rid, len(req.token_ids), req.device_hit, req.host_hit_length,
            req.loaded, req.cache_protected_len, retract,
        )  # fmt: skip

    # -------------------------------------------------------- invariants / log
    def _state_record(self) -> tuple:
        """Replicated state after a step; a full tree digest every few steps."""
        record = (
            "state",
            self.allocator.available_size(),
            self.cache.evictable_size_,
            self.cache.protected_size_,
            len(self.cache.ongoing_write_through),
            len(self.cache.ongoing_load_back),
            self.ledger.host_used_logical_tokens(),
            self.counters.device_evicted_tokens,
            self.counters.host_evicted_tokens,
        )
        if self.step_index % self.tree_digest_every == 0:
            record += (self._check_tree().digest,)
        return record

    def _tree_summary(self) -> TreeSummary:
        return tree_summary(self.cache)

    def _check_tree(self) -> TreeSummary:
        summary = tree_summary(self.cache)
        self.ledger.check_tree(summary)
        return summary

    def _sample_series(self) -> None:
        draft = self.ledger.host_used_physical_tokens() * self.draft_bytes_per_token
        self.draft_host_peak = max(self.draft_host_peak, draft)
        self._sample_host_usage()

    def _read_backup_stats(self) -> None:
        """The pending-backup state machine's counts (CP cache only; replicated)."""
        stats = getattr(self.cache, "pending_stats", None)
        if stats is None:
            return
        c = self.counters
        c.pending_committed = stats.committed
        c.pending_rolled_back = stats.rolled_back
        c.deferred_splits = stats.deferred_splits
        c.backups_skipped_host_full = self.cache.capacity_refusals.host_writes

    def _finish_run(self, stopped: Optional[str]) -> RankResult:
        summary, leaks = self._final_checks(stopped)
        self._read_backup_stats()
        if self.shared_kv and self.cache.device_value_reads:
            self._violation(
                f"{self.cache.device_value_reads} node runs were read back from node.value "
                "instead of coming from host state"
            )
        return self._rank_result(
            stopped,
            summary,
            leaks,
            self.shared_kv,
            draft_bytes_per_token=self.draft_bytes_per_token,
            draft_d2h_bytes=self.observer.d2h_tokens * self.draft_bytes_per_token,
            draft_h2d_bytes=self.observer.h2d_tokens * self.draft_bytes_per_token,
            draft_host_peak_bytes=self.draft_host_peak,
            pd=None if self.pd is None else self.pd.stats,
        )
