"""One 0.5.12.post1 PD prefill rank (:class:`PrefillRank`): the plugin's CP cache stack
driven as SGLang's disaggregated prefill scheduler drives it, and its role body."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.testing.pd.engine import SentBytesMeter, init_transfer_engine
from sglang_cp_hicache.testing.pd.roles import LOOPBACK, PDPorts, RoleChannel
from sglang_cp_hicache.testing.pd.scenario import PDRequest, PrefillOutcome
from sglang_cp_hicache.testing.pd.steps import PrefillSteps, load_plugins
from sglang_cp_hicache.testing.v0_5_12.pd_harness.context import (
    PrefillSchedulerFields,
    install_parallel_state,
    pd_server_args,
)
from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import (
    HIDDEN_SIZE,
    PAGE_SIZE,
    PDScenario,
    host_buffers,
    pool_buffers,
    planted_filter,
)


# ------------------------------------------------------------------ prefill
class PrefillRank(PrefillSteps):
    """One prefill CP rank: the plugin's cache stack under upstream's PD prefill path."""

    def __init__(self, ctx: Any, scenario: PDScenario, ports: PDPorts, stack: Any = None):
        """``stack``: a rank stack another driver runs (the simulator's); None builds one."""
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend

        from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

        self.ctx, self.scenario, self.ns = ctx, scenario, nsa_stack
        cfg = nsa_stack.StackConfig(
            cp_size=scenario.cp_size,
            layer_num=scenario.layer_num,
            physical_tokens=PAGE_SIZE * scenario.prefill_pages_per_rank,
            page_size=PAGE_SIZE,
            draft=scenario.draft,
        )
        if stack is None:
            stack = nsa_stack.build_rank_stack(cfg, ctx.rank, ctx.cp_group, ctx.attn_tp_group)
        self.stack = stack
        self.server_args = pd_server_args("prefill", scenario.cp_size, ports.bootstrap, scenario.draft)
        self.meter = SentBytesMeter(init_transfer_engine())
        self.metadata_allocator = ReqToMetadataIdxAllocator(8)
        self.fields = PrefillSchedulerFields(
            server_args=self.server_args,
            tree_cache=self.stack.cache,
            req_to_token_pool=self.stack.req_to_token_pool,
            token_to_kv_pool_allocator=self.stack.allocator,
            attn_cp_cpu_group=ctx.cp_group,
            attn_tp_cpu_group=ctx.attn_tp_group,
            disagg_metadata_buffers=MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16),
            model_config=SimpleNamespace(num_hidden_layers=scenario.layer_num),
        )
        self.queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.stack.kv_pool,
            draft_token_to_kv_pool=self.stack.draft_pool,
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.fields.disagg_metadata_buffers,
            tp_rank=ctx.rank,
            tp_size=scenario.cp_size,
            gpu_id=0,
            bootstrap_port=ports.bootstrap,
            gloo_group=ctx.cp_group,
            max_total_num_tokens=self.stack.allocator.size,
            scheduler=self.fields,
            pp_rank=0,
            pp_size=1,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.fields.disagg_prefill_bootstrap_queue = self.queue
        self.kv_manager = self.queue.kv_manager
        self.baseline = self._resources()

    # -- bookkeeping
    def _free_kv(self) -> int:
        return self.stack.allocator.available_size()

    def _snapshot(self) -> List[torch.Tensor]:
        pools = pool_buffers([self.stack.kv_pool, self.stack.draft_pool])
        return [b.clone() for b in pools + host_buffers(self.stack.cache)]

    def _unchanged(self, snapshot: List[torch.Tensor]) -> bool:
        pools = pool_buffers([self.stack.kv_pool, self.stack.draft_pool])
        return all(torch.equal(a, b) for a, b in zip(snapshot, pools + host_buffers(self.stack.cache)))

    # -- scheduler steps
    def evict_device(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache = self.stack.cache
        cache.check_hicache_events()
        cache.evict(EvictParams(num_tokens=10**9))
        cache.check_hicache_events()
        self.ns.wipe_device_kv(self.stack)
        self.baseline = self._resources()

    def _poll(self, req: Any) -> int:
        """The request's transfer state, all-reduced over CP as the scheduler polls it."""
        from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

        return poll_and_all_reduce_attn_cp_tp_group([req.disagg_kv_sender], self.ctx.cp_group, self.ctx.attn_tp_group)[0]

    def _admit(self, req: Any) -> Tuple[int, int]:
        """Prefix match, lock and host load-back, as ``PrefillAdder.add_one_req`` does;
        returns (device hit tokens, host hit tokens)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        cache = self.stack.cache
        req.init_next_round_input(cache)
        device_hit, host_hit = len(req.prefix_indices), req.host_hit_length
        if host_hit > 0:
            loaded, req.last_node = cache.init_load_back(
                InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=host_hit, req=req)
            )
            req.prefix_indices = torch.cat([req.prefix_indices, loaded])
            req.cache_protected_len = len(req.prefix_indices)
            cache.ready_to_load_host_cache()
            cache.check_hicache_events()
        cache.inc_lock_ref(req.last_node)
        return device_hit, host_hit

    def _chunk_ends(self, spec: PDRequest, prefix_len: int) -> List[int]:
        """Where each forward ends: SGLang's first chunk ends on a page boundary, later
        chunks take ``chunk_tokens`` each."""
        total = len(spec.token_ids)
        if spec.chunk_tokens is None:
            return [total]
        first = (prefix_len + spec.chunk_tokens) // PAGE_SIZE * PAGE_SIZE
        ends = [first] if prefix_len < first < total else []
        while ends and ends[-1] + spec.chunk_tokens < total:
            ends.append(ends[-1] + spec.chunk_tokens)
        return ends + [total]

    def _forward(self, req: Any, end: int) -> None:
        """One EXTEND forward up to ``end``: SGLang's allocation, the owned KV stores."""
        from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch

        start = len(req.prefix_indices)
        req.fill_ids = list(req.origin_input_ids[:end])
        batch = scheduler_batch.extend_batch(self.stack, [req], [end])
        ids, pos = torch.tensor(req.fill_ids[start:end]), torch.arange(start, end)
        self.ns.write_prefill_kv(self.stack, batch.out_cache_loc, ids, pos)
        req.kv_committed_len = req.kv_allocated_len = end  # what prepare_for_extend and the forward set

    def _prefill(self, channel: RoleChannel, req: Any, spec: PDRequest, out: PrefillOutcome) -> Optional[float]:
        """Every forward of ``req``; each chunk but the last is cached and sent as it
        finishes (upstream's ``process_prefill_chunk``). Returns when the harness released
        the ``chunk-sent`` checkpoint, if this request pauses there."""
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        released_at = None
        ends = self._chunk_ends(spec, len(req.prefix_indices))
        out.chunks = len(ends)
        for i, end in enumerate(ends[:-1]):
            self._forward(req, end)
            self.stack.cache.cache_unfinished_req(req, chunked=True)
            self.stack.cache.check_hicache_events()
            SchedulerDisaggregationPrefillMixin.send_kv_chunk(self.fields, req)
            if i == 0 and spec.rid == self.scenario.pause_after_chunk:
                channel.checkpoint("chunk-sent", spec.rid)
                released_at = time.monotonic()
        self._forward(req, ends[-1])
        return released_at

    def _set_first_token(self, req: Any, spec: PDRequest) -> None:
        """The first output token (and, with MTP, the draft's state for decode)."""
        req.output_ids.append(spec.next_token)
        if self.scenario.draft:
            req.output_topk_p = torch.full((1,), 0.5)
            req.output_topk_index = torch.tensor([spec.next_token])
            req.hidden_states_tensor = expected_hidden_state(spec)

    def _finish_prefill(self, req: Any, spec: PDRequest) -> None:
        """What ``process_batch_result_disagg_prefill`` does before the last send: the
        first output token and the cache."""
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

        self._set_first_token(req, spec)
        maybe_cache_unfinished_req(req, self.stack.cache)
        self.stack.cache.check_hicache_events()

    def _send_last_chunk(self, req: Any, deadline: float) -> int:
        """The last chunk (with state pages and aux), then the CP-wide poll until it ends."""
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        SchedulerDisaggregationPrefillMixin.send_kv_chunk(self.fields, req, last_chunk=True)
        return self._wait_done(req, deadline)

    def _owned_pages(self, req: Any) -> int:
        row = self.stack.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)]
        logical_pages = row[::PAGE_SIZE] // PAGE_SIZE
        return int((lane_of(logical_pages, self.scenario.cp_size) == self.ctx.rank).sum())

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the prefill server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=list(spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=1), bootstrap_host=LOOPBACK,
            bootstrap_room=spec.room,
        )  # fmt: skip

    def send_prefilled(self, spec: PDRequest, req_pool_idx: int) -> PrefillOutcome:
        """Transfer a request another driver prefilled on this rank's stack (its locs in
        ``req_to_token[req_pool_idx]``, every prompt token's KV stored): the bootstrap, the
        whole prompt as the last chunk with its aux data, the CP-wide poll. The caller
        keeps the KV and releases it (``cache_finished_req``) afterwards."""
        from sglang.srt.disaggregation.prefill import release_req_to_metadata_buffer

        deadline = time.monotonic() + self.scenario.transfer_timeout_s
        out = PrefillOutcome(spec.rid, self.ctx.rank, success=False, chunks=1)
        req = self._new_req(spec)
        if not self._bootstrap(req, deadline):
            out.failure = str(req.finished_reason.message)
            release_req_to_metadata_buffer(req, self.metadata_allocator)
            return out
        req.req_pool_idx, req.fill_ids = req_pool_idx, list(spec.token_ids)
        self._set_first_token(req, spec)
        out.owned_pages = self._owned_pages(req)
        bytes_before, engine_before = self.meter.total, self.meter.engine_s
        sent_at = time.monotonic()
        poll = self._send_last_chunk(req, deadline)
        out.transfer_s, out.engine_s = time.monotonic() - sent_at, self.meter.engine_s - engine_before
        self._close_sender(req, out, poll)
        req.req_pool_idx = None  # the row stays the caller's
        release_req_to_metadata_buffer(req, self.metadata_allocator)
        out.payload_bytes = self._payload_bytes(out, bytes_before)
        return out

    def serve(self, channel: RoleChannel, spec: PDRequest) -> PrefillOutcome:
        """Serve ``spec`` as SGLang's disaggregated prefill does; report what this rank saw."""
        from sglang.srt.disaggregation.prefill import release_req_to_metadata_buffer
        from sglang.srt.mem_cache.common import release_kv_cache

        deadline = time.monotonic() + self.scenario.transfer_timeout_s
        out = PrefillOutcome(spec.rid, self.ctx.rank, success=False)
        req = self._new_req(spec)
        if not self._bootstrap(req, deadline):
            out.failure = str(req.finished_reason.message)
            release_req_to_metadata_buffer(req, self.metadata_allocator)
            out.leaked = self._leaks()
            return out
        out.device_hit_tokens, out.host_hit_tokens = self._admit(req)
        bytes_before, engine_before = self.meter.total, self.meter.engine_s
        released_at = self._prefill(channel, req, spec, out)
        self._finish_prefill(req, spec)
        out.owned_pages, snapshot = self._owned_pages(req), self._snapshot()
        sent_at = time.monotonic()
        poll = self._send_last_chunk(req, deadline)
        done_at = time.monotonic()
        out.transfer_s, out.engine_s = done_at - sent_at, self.meter.engine_s - engine_before
        out.failure_detected_s = done_at - released_at if released_at is not None else 0.0
        out.pools_unchanged = self._unchanged(snapshot)
        self._close_sender(req, out, poll)
        release_kv_cache(req, self.stack.cache)
        release_req_to_metadata_buffer(req, self.metadata_allocator)
        self.stack.cache.check_hicache_events()
        out.payload_bytes = self._payload_bytes(out, bytes_before)
        out.leaked = self._leaks()
        return out


def expected_hidden_state(spec: PDRequest) -> torch.Tensor:
    """The MTP hidden state prefill carries for ``spec`` (bf16-exact small integers)."""
    return ((torch.arange(HIDDEN_SIZE) + spec.next_token) % 97 - 48).to(torch.bfloat16)


def prefill_rank_role(channel: RoleChannel, rank: int, scenario: PDScenario, ports: PDPorts) -> List[Any]:
    """Role: prefill CP rank ``rank``; returns one :class:`PrefillOutcome` per request."""
    from sglang_cp_hicache.testing.dist import init_rank_groups
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_support import unsupported_serving_modes

    load_plugins()
    ctx = init_rank_groups(rank, scenario.cp_size, ports.gloo, timeout_s=scenario.transfer_timeout_s + 30)
    install_parallel_state(scenario.cp_size, rank)
    with scheduler_batch.cpu_scheduler_server_args(PAGE_SIZE):
        server = PrefillRank(ctx, scenario, ports)
        problems = unsupported_serving_modes(server.server_args)
        if problems:  # the plugin's launch check would refuse this prefill server
            raise RuntimeError("; ".join(problems))
        return server.serve_steps(channel, planted_filter)


__all__ = [
    "expected_hidden_state",
    "prefill_rank_role",
    "PrefillRank",
]
