"""One 0.5.23 PD prefill rank (:class:`PrefillRank`): upstream's sharded stack with the
plugin's flag under upstream's PD prefill path, and its role body."""

from __future__ import annotations

import time
from array import array
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.pd.engine import SentBytesMeter, init_transfer_engine
from sglang_cp_hicache.testing.pd.roles import LOOPBACK, PDPorts, RoleChannel
from sglang_cp_hicache.testing.pd.scenario import PDRequest, PrefillOutcome
from sglang_cp_hicache.testing.pd.steps import PrefillSteps, load_plugins
from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import (
    PrefillSchedulerFields,
    dsa_model_config,
    publish_pd_record,
    stamp_parallel,
)
from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import (
    HIDDEN_SIZE,
    PAGE_SIZE,
    PDScenario,
    pool_buffers,
    build_draft_pool,
    expected_hidden_state,
    planted_filter,
    write_owned_kv,
)


# ------------------------------------------------------------------ prefill
class PrefillRank(PrefillSteps):
    """One prefill CP rank: the real 0.5.23 sharded stack under upstream's PD prefill path."""

    def __init__(self, ctx: Any, scenario: PDScenario, ports: PDPorts, stack: Any = None):
        """Every rank of ``ctx.cp_group`` builds one. ``stack``: a sharded ``RankStack``
        this process already serves from (a simulator rank); None builds
        ``scenario.stack_config()``'s. The PD record is published over the stack's."""
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend

        from sglang_cp_hicache.testing.v0_5_23.stack import build_sharded_stack

        self.ctx, self.scenario = ctx, scenario
        self.stack = stack if stack is not None else build_sharded_stack(ctx, scenario.stack_config())
        self.draft_pool = None
        if scenario.draft:  # a stack with its own MTP draft (a simulator rank's) sends that one
            own = self.stack.draft_kv_pool
            self.draft_pool = own if own is not None else build_draft_pool(self.stack)
        self.server_args = publish_pd_record("prefill", ports.bootstrap, self.stack.config)
        stamp_parallel(scenario.cp_size, ctx.rank, ctx.cp_group, ctx.attn_tp_group)
        self.meter = SentBytesMeter(init_transfer_engine())
        self.metadata_allocator = ReqToMetadataIdxAllocator(8)
        logical_tokens = self.stack.allocator.size
        self.fields = PrefillSchedulerFields(
            server_args=self.server_args,
            tree_cache=self.stack.cache,
            req_to_token_pool=self.stack.req_to_token_pool,
            token_to_kv_pool_allocator=self.stack.allocator,
            attn_cp_cpu_group=ctx.cp_group,
            attn_tp_cpu_group=ctx.attn_tp_group,
            disagg_metadata_buffers=MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16, 0),
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            model_config=dsa_model_config(scenario.layer_num),
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False,
                model_runner=SimpleNamespace(
                    effective_logical_max_total_num_tokens=logical_tokens // scenario.cp_size,
                    kv_cache_dtype_str="bfloat16",
                ),
            ),
            kv_shard_widening=scenario.cp_size,
        )
        self.queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.stack.kv_pool,
            draft_token_to_kv_pool=self.draft_pool,
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.fields.disagg_metadata_buffers,
            gpu_id=0,
            bootstrap_port=ports.bootstrap,
            max_total_num_tokens=logical_tokens,
            scheduler=self.fields,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.fields.disagg_prefill_bootstrap_queue = self.queue
        self.kv_manager = self.queue.kv_manager
        self.baseline = self._resources()

    # -- bookkeeping
    def _free_kv(self) -> int:
        """Free logical KV of every owner class, not the min-class admission floor."""
        return self.stack.allocator.aggregate_free_size()

    def _tier_buffers(self) -> List[torch.Tensor]:
        """This rank's device pool and host tier (KV anchor and DSA indexer host pools)."""
        host = [entry.host_pool for entry in self.stack.host_pool_group.entries]
        names = ("kv_buffer", "index_k_with_scale_buffer")
        host_buffers = [getattr(pool, name) for pool in host for name in names if hasattr(pool, name)]
        device = pool_buffers(self.stack.kv_pool)
        if self.draft_pool is not None:
            device += pool_buffers(self.draft_pool)
        return device + [b for b in host_buffers if isinstance(b, torch.Tensor)]

    def _snapshot(self) -> List[torch.Tensor]:
        return [b.clone() for b in self._tier_buffers()]

    def _unchanged(self, snapshot: List[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(snapshot, self._tier_buffers()))

    # -- scheduler steps
    def evict_device(self) -> None:
        """Back everything up, evict it from device and wipe the device bytes."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache = self.stack.cache
        cache.flush_pending_backups()
        cache.writing_check()
        cache.evict(EvictParams(num_tokens=self.stack.allocator.size))
        for buffer in pool_buffers(self.stack.kv_pool):
            buffer.zero_()
        self.baseline = self._resources()

    def _poll(self, req: Any) -> int:
        from sglang.srt.disaggregation.utils import poll_and_all_reduce_attn_cp_tp_group

        senders = [req.disagg_kv_sender]
        return poll_and_all_reduce_attn_cp_tp_group(senders, self.ctx.cp_group, self.ctx.attn_tp_group)[0]

    def _admit(self, req: Any, spec: PDRequest) -> Tuple[torch.Tensor, Optional[int], Any, int, int]:
        """Prefix match, host load-back, lock: (prefix logical locs, rotation base, tree
        lock, device hit tokens, host hit tokens)."""
        cache = self.stack.cache
        match = self.stack.match(spec.token_ids)
        device_hit, host_hit = match.device_prefix_len, match.host_hit_length
        node = match.last_device_node
        if host_hit > 0:
            if not cache.load_back(match.best_match_node):
                raise RuntimeError(f"rank {self.ctx.rank}: load-back of {spec.rid} refused")
            cache.ready_to_load_host_cache()
            cache.loading_check()
            match = self.stack.match(spec.token_ids)
            if match.device_prefix_len != device_hit + host_hit:
                raise RuntimeError(
                    f"rank {self.ctx.rank}: {spec.rid} load-back left {match.device_prefix_len} tokens"
                )
            node = match.last_device_node
        prefix = cache.path_device_indices(node).to(torch.int64)
        return prefix, cache.rotation_base_of(node), cache.lock(node), device_hit, host_hit

    def _chunk_ends(self, spec: PDRequest, prefix_len: int) -> List[int]:
        """Where each forward ends: ``chunk_tokens`` per chunk, every chunk but the last
        floored to a page (sharded admission aligns chunk boundaries to pages,
        ``schedule_policy.py:720-724``; the sharded allocator asserts it)."""
        total = len(spec.token_ids)
        if spec.chunk_tokens is None:
            return [total]
        ends, end = [], prefix_len
        while (end + spec.chunk_tokens) // PAGE_SIZE * PAGE_SIZE < total:
            end = (end + spec.chunk_tokens) // PAGE_SIZE * PAGE_SIZE
            if end <= (ends[-1] if ends else prefix_len):
                raise ValueError(f"{spec.rid}: chunk_tokens {spec.chunk_tokens} below a page")
            ends.append(end)
        return ends + [total]

    def _forward(
        self, req: Any, spec: PDRequest, locs: torch.Tensor, base: Optional[int], end: int
    ) -> Tuple[torch.Tensor, Optional[int]]:
        """One extend forward up to ``end``: upstream's sharded ``alloc_extend`` (the
        chain's rotation continued), the request's row, the owned stores."""
        start = len(locs)
        req.extend_end = end
        if start == end:  # a finished request's KV all in the tree: nothing to compute
            return locs, base
        new, base = self.stack.alloc_extend(locs, end, base)
        row = self.stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        row[start:end] = new.to(row.dtype)
        ids, pos = torch.tensor(spec.token_ids[start:end]), torch.arange(start, end)
        write_owned_kv(self.stack, new, ids, pos, self.draft_pool)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = end
        return torch.cat([locs, new]), base

    def _send(self, req: Any, last_chunk: bool) -> None:
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        SchedulerDisaggregationPrefillMixin._send_kv_chunk(self.fields, req, last_chunk=last_chunk)

    def owned_pages(self, locs: torch.Tensor) -> int:
        return int(self.stack.owned_mask(locs[::PAGE_SIZE]).sum())

    def _first_token(self, req: Any, spec: PDRequest) -> None:
        """The first output token (and, with MTP, what the draft's first step hands on)."""
        req.output_ids.append(spec.next_token)
        if self.draft_pool is not None:
            req.output_topk_p = torch.full((1,), 0.5)
            req.output_topk_index = torch.tensor([spec.next_token])
            req.hidden_states_tensor = expected_hidden_state(spec)

    def send_prefilled(self, spec: PDRequest, req_pool_idx: int) -> PrefillOutcome:
        """Transfer a request another driver prefilled on this rank's stack (its logical
        locs in ``req_to_token[req_pool_idx]``, every prompt token's KV stored on its
        owners): the bootstrap, the whole prompt as the last chunk with its aux data, the
        CP-wide poll. No cache call: the caller keeps the KV and the row and releases them
        afterwards. Every rank of the CP group calls it for the same request."""
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        deadline = time.monotonic() + self.scenario.transfer_timeout_s
        out = PrefillOutcome(spec.rid, self.ctx.rank, success=False, chunks=1)
        req = self._new_req(spec)
        if not self._bootstrap(req, deadline):
            out.failure = str(req.finished_reason.message)
            maybe_release_metadata_buffer(req, self.metadata_allocator)
            return out
        req.kv.req_pool_idx, req.extend_end = req_pool_idx, len(spec.token_ids)
        self._first_token(req, spec)
        row = self.stack.req_to_token_pool.req_to_token[req_pool_idx, : len(spec.token_ids)]
        out.owned_pages = self.owned_pages(row.to(torch.int64))
        bytes_before, engine_before, sent_at = self.meter.total, self.meter.engine_s, time.monotonic()
        self._send(req, last_chunk=True)
        poll = self._wait_done(req, deadline)
        out.transfer_s, out.engine_s = time.monotonic() - sent_at, self.meter.engine_s - engine_before
        self._close_sender(req, out, poll)
        req.kv.req_pool_idx = None  # the row stays the caller's
        maybe_release_metadata_buffer(req, self.metadata_allocator)
        out.payload_bytes = self._payload_bytes(out, bytes_before)
        return out

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the prefill server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=array("q", spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=1), bootstrap_host=LOOPBACK,
            bootstrap_room=spec.room,
        )  # fmt: skip

    def serve(self, channel: Optional[RoleChannel], spec: PDRequest) -> PrefillOutcome:
        """Serve ``spec`` as upstream's disaggregated prefill does and report what this rank
        saw; every rank of the CP group must call it for the same request."""
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        deadline = time.monotonic() + self.scenario.transfer_timeout_s
        out = PrefillOutcome(spec.rid, self.ctx.rank, success=False)
        req = self._new_req(spec)
        if not self._bootstrap(req, deadline):
            out.failure = str(req.finished_reason.message)
            maybe_release_metadata_buffer(req, self.metadata_allocator)
            out.leaked = self._leaks()
            return out
        locs, base, lock, out.device_hit_tokens, out.host_hit_tokens = self._admit(req, spec)
        cached_len = len(locs)
        self.stack.req_to_token_pool.alloc([req])
        row = self.stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        row[:cached_len] = locs.to(row.dtype)
        bytes_before, engine_before = self.meter.total, self.meter.engine_s
        ends = self._chunk_ends(spec, cached_len)
        out.chunks, released_at = len(ends), None
        for i, end in enumerate(ends):
            locs, base = self._forward(req, spec, locs, base, end)
            if end == ends[-1]:
                break
            self._send(req, last_chunk=False)
            if i == 0 and channel is not None and spec.rid == self.scenario.pause_after_chunk:
                channel.checkpoint("chunk-sent", spec.rid)
                released_at = time.monotonic()
        self._first_token(req, spec)
        snapshot, out.owned_pages = self._snapshot(), self.owned_pages(locs)
        sent_at = time.monotonic()
        self._send(req, last_chunk=True)
        poll = self._wait_done(req, deadline)
        done_at = time.monotonic()
        out.transfer_s, out.engine_s = done_at - sent_at, self.meter.engine_s - engine_before
        out.failure_detected_s = done_at - released_at if released_at is not None else 0.0
        out.pools_unchanged = self._unchanged(snapshot)
        self._close_sender(req, out, poll)
        self._release(req, spec, locs, base, lock, cached_len)
        maybe_release_metadata_buffer(req, self.metadata_allocator)
        out.payload_bytes = self._payload_bytes(out, bytes_before)
        out.leaked = self._leaks()
        return out

    def _release(
        self, req: Any, spec: PDRequest, locs: torch.Tensor, base: Optional[int], lock: Any, cached_len: int
    ) -> None:
        """The request ends: its KV goes into the tree (the partial last page freed), its
        lock, row and slot are given back."""
        full = len(locs) // PAGE_SIZE * PAGE_SIZE
        self.stack.insert(spec.token_ids[:full], locs[:full], base, cached_len=cached_len)
        if full < len(locs):
            self.stack.allocator.free(locs[full:])
        self.stack.cache.unlock(lock)
        self.stack.req_to_token_pool.free(req)
        # The scheduler's next step acks the write-through backups (they lock the nodes).
        self.stack.cache.flush_pending_backups()
        self.stack.cache.writing_check()


def prefill_rank_role(channel: RoleChannel, rank: int, scenario: PDScenario, ports: PDPorts) -> List[PrefillOutcome]:
    """Role: prefill CP rank ``rank``; one :class:`PrefillOutcome` per request it serves."""
    from sglang_cp_hicache.testing.dist import init_rank_groups

    load_plugins()
    ctx = init_rank_groups(rank, scenario.cp_size, ports.gloo, timeout_s=scenario.transfer_timeout_s + 30)
    server = PrefillRank(ctx, scenario, ports)
    outcomes = server.serve_steps(channel, planted_filter)
    server.stack.close()
    return outcomes


__all__ = [
    "prefill_rank_role",
    "PrefillRank",
]
