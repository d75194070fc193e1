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
5. "forward": the hit's bytes checked on this rank's owned rows, the pattern KV and
   indexer bytes of the new tokens written into them; with per-layer D2H backup (the
   plugin column's default), ``Scheduler.run_batch``'s hook first reserves host slots
   for the batch's new leaves, and the forward stores layer by layer through the pool's
   own ``set_mla_kv_buffer`` (its store hook backs each layer up) inside
   ``ModelRunner.forward``'s hook (the forward's end), as ``layer_backup.py`` expects;
6. a middle chunk: ``checkpoint_kv_cache``; the last chunk: ``checkpoint_kv_cache``, then
   (the KV transfer done) ``release_kv_cache(checkpoint=True)`` and ``finish``; a
   retraction: ``release_kv_cache(checkpoint=False)``, the request re-queued.

Requests are real ``Req`` objects. Only cache calls are timed, with collectives counted;
checks, KV writes and the cross-rank agreement check run outside. All ranks make identical
calls, so the decision log (hashed per step) must agree.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
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
    store_draft_layer,
    store_prefill_layer,
    tree_summary,
    verify_draft_hit,
    verify_hit,
    write_draft_kv,
    write_prefill_kv,
)
from sglang_cp_hicache.sim.v0_5_23.invariants import LayerBackupLedger, PoolLedger
from sglang_cp_hicache.sim.v0_5_23.observed_cache import CacheObserver, DeclinedInsert
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import fresh_write_plan
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack

logger = logging.getLogger(__name__)

#: ``--max-prefill-tokens``' default: the input tokens one prefill batch may carry.
MAX_PREFILL_TOKENS = 16384
_OUTPUT_TOKEN = 0  # the one token a PD prefill server generates (never cached)


@dataclass(eq=False)
class SimReq:
    """One trace request and its real ``Req`` (one per attempt: a retraction re-queues a
    fresh one), with what the driver records of its first chunk."""

    request: Request
    attempt: int = 0
    req: Any = None  # sglang.srt.managers.schedule_batch.Req
    started: bool = False  # its first chunk ran (counters and the hit check are done)
    device_hit: int = 0
    host_hit: int = 0

    def __post_init__(self) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        if self.req is None:
            self.req = Req(
                rid=self.rid,
                origin_input_text="",
                origin_input_ids=array("q", self.request.token_ids),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
            )

    @property
    def rid(self) -> str:
        return f"{self.request.index}:{self.attempt}"

    @property
    def prompt(self) -> Sequence[int]:
        return self.request.token_ids

    @property
    def last_chunk(self) -> bool:
        return self.req.extend_end == len(self.prompt)


@dataclass
class RejectedKeys:
    """Keys of inserts the tree declined, to price the hits they cost: the page-aligned
    prompt prefix a later request shares with a declined key, beyond what it matched.
    Indexed by first page (only keys with the same first page can share a prefix)."""

    page_size: int
    by_first_page: Dict[Tuple[int, ...], List[np.ndarray]] = field(default_factory=dict)

    def add(self, declined: DeclinedInsert) -> None:
        key = np.asarray(declined.token_ids, dtype=np.int64)
        if len(key) >= self.page_size:
            self.by_first_page.setdefault(tuple(key[: self.page_size]), []).append(key)

    def potential_match(self, prompt: Sequence[int]) -> int:
        """The longest page-aligned prefix of ``prompt[:-1]`` any declined key holds."""
        tokens = np.asarray(prompt[: len(prompt) - 1], dtype=np.int64)
        best = 0
        for key in self.by_first_page.get(tuple(tokens[: self.page_size]), ()):
            n = min(len(key), len(tokens))
            differ = np.nonzero(key[:n] != tokens[:n])[0]
            common = int(differ[0]) if len(differ) else n
            best = max(best, common // self.page_size * self.page_size)
        return best


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
        self.layer_backup, self.layer_ledger = self._attach_layer_backup(features.per_layer_backup)
        self.attention_layers = self._attention_layers() if self.layer_backup is not None else []
        self.draft_attention_layers = self._draft_attention_layers()
        # SimConfig.pd: every finished prefill goes to the decode process (prefill roles only).
        self.pd = attach_pd_link(stack) if stack.sharded else None

    def _attach_layer_backup(self, per_layer: bool) -> Tuple[Any, Optional[LayerBackupLedger]]:
        """The stack's per-layer D2H backup when the column runs it (the plugin's flag
        attaches it at ``init_hicache`` on either host layout, or the stack's start-up
        failed with ``PerLayerBackupUnavailable``), observed and checked;
        (None, None) for upstream's all-layer path."""
        from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

        if not per_layer:
            return None, None
        backup = layer_backup_of(self.cache)
        if backup is None:
            raise SimulationError("per_layer_backup: the stack has no per-layer D2H backup attached")
        self.observer.attach_layer_backup(backup, self.stack)
        return backup, LayerBackupLedger(backup, self.stack, self.counters, self._violation)

    def _attention_layers(self) -> List[Any]:
        """The model's attention layers, as the pool's store door takes them."""
        from sglang.srt.layers.radix_attention import RadixAttention

        dim = self.stack.config.kv_cache_dim
        return [
            RadixAttention(num_heads=1, head_dim=dim, scaling=1.0, num_kv_heads=1, layer_id=layer_id)
            for layer_id in range(self.stack.config.layer_num)
        ]

    def _draft_attention_layers(self) -> List[Any]:
        """The MTP draft's attention layers (its own pool's layer ids); none without it."""
        from sglang.srt.layers.radix_attention import RadixAttention

        dim = self.stack.config.kv_cache_dim
        return [
            RadixAttention(num_heads=1, head_dim=dim, scaling=1.0, num_kv_heads=1, layer_id=layer_id)
            for layer_id in range(self.stack.config.draft_layer_num)
        ]

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
                self._run_batch(schedule_batch, batch)
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
    def _run_batch(self, schedule_batch: Any, batch: List[SimReq]) -> None:
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
        new_kv: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

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
            run_batch_around(upstream_run_batch, SimpleNamespace(tree_cache=self.cache), schedule_batch)
        except PerLayerBackupIncomplete as exc:
            raise SimulationError(f"per-layer backup refused the forward: {exc}") from None

    def _forward(self, batch: List[SimReq]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the model does with the batch: read the hit (target and MTP draft bytes),
        write the new tokens' KV (with per-layer backup, layer by layer over the whole batch
        through the pool; the draft's layer is then the draft forward's, in
        :meth:`_run_batch`). Returns the batch's new (locs, tokens, positions)."""
        rows = self.req_pool.req_to_token
        new_kv: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
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
                self._count_first_chunk(sreq, mismatches, checked)
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

    def _count_first_chunk(self, sreq: SimReq, mismatches: int, checked: int) -> None:
        sreq.started = True
        loaded = sreq.req.host_loaded_length
        c = self.counters
        c.kv_mismatches += mismatches
        c.kv_checked_tokens += checked
        c.requests += 1
        c.prompt_tokens += len(sreq.prompt)
        c.device_hit_tokens += sreq.device_hit
        c.host_matched_tokens += sreq.host_hit
        c.host_hit_tokens += loaded
        c.load_backs += int(loaded > 0)
        c.load_back_failures += int(sreq.host_hit > 0 and loaded == 0)
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
