"""The 0.5.12.post1 line's PD roles: CP prefill ranks and one decode server, real stack end to end.

Each prefill rank (one process, gloo CP group) is the plugin's cache stack (physical NSA pools,
logical owner-lane allocator, CP HiCache; with ``draft``, the MTP draft's pool beside) driven
as SGLang's disaggregated prefill scheduler drives it: upstream's ``PrefillBootstrapQueue``
(its ``MooncakeKVManager`` and ``MooncakeKVSender``), admission (prefix match, host
load-back), chunked forwards through ``alloc_for_extend``, ``send_kv_chunk`` of upstream's
prefill mixin, the CP-all-reduced poll, ``release_kv_cache``. The forward's KV stores are the
deterministic pattern of :mod:`nsa_stack` (owned tokens only, as the shared-KV write path
stores them). The plugin is loaded as SGLang loads it, so its owner filters run inside
upstream's sender.

The decode server (cp 1, one process) holds a full, unsharded pool and runs upstream's
``DecodePreallocQueue`` / ``DecodeTransferQueue`` (``MooncakeKVReceiver``). Its pool starts
filled with a sentinel; after each transfer it checks, byte for byte against the pattern
(the replicated reference: what an unsharded prefill holds), every token's KV, indexer
K/scale and draft KV, the first output token carried as aux data, and at the end that no
page outside the ones it granted changed.

Only the ``Scheduler`` object is a stand-in (it needs a model and a GPU): the dataclasses
below carry exactly the fields upstream's PD queues read. SGLang's parallel-state groups are
stand-ins of the same kind (:class:`GroupShape`): the PD managers read only their sizes and
ranks; the collectives run on the real gloo groups.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.testing.pd import (
    LOOPBACK,
    SENTINEL_BYTE,
    DecodeChecks,
    DecodeOutcome,
    DecodeReport,
    ErrorLog,
    EvictDevice,
    PDLine,
    PDPorts,
    PLANTS,
    PDRequest,
    PrefillOutcome,
    PrefillSteps,
    REGISTERED,
    RoleChannel,
    ScenarioSteps,
    SentBytesMeter,
    Step,
    hold_if_asked,
    init_transfer_engine,
    load_plugins,
)

PAGE_SIZE = 64
HIDDEN_SIZE = 64  # the metadata buffers' hidden state (MTP: carried to decode)


# ------------------------------------------------------------------ scenario


@dataclass(frozen=True)
class PDScenario(ScenarioSteps):
    """What every role of one cluster runs.

    ``plants`` (negative controls) maps a request id to a bug planted in the plugin's owner
    filter on the prefill ranks while that request is served: ``wrong_owner`` makes each
    rank send the pages of the next rank's lane from its own slots; ``rank_skips_send``
    makes the last rank send no pages (it still reports its status). The decode re-checks a
    planted request at the end apart from the others (``final_planted_kv_mismatches``), so
    one cluster serves both. ``pause_after_chunk`` names a
    request whose prefill ranks stop after their first chunk until the harness answers the
    ``chunk-sent`` checkpoint (the decode-killed fault). ``hold_after_registering``: the
    prefill ranks wait for the harness's ``go`` once registered (the fault cluster's decodes
    start meanwhile).
    """

    cp_size: int
    steps: Tuple[Step, ...]
    draft: bool = False
    layer_num: int = 2
    prefill_pages_per_rank: int = 32
    decode_pages: int = 160
    plants: Tuple[Tuple[str, str], ...] = ()
    pause_after_chunk: Optional[str] = None
    hold_after_registering: bool = False
    transfer_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_plants()


# ------------------------------------------------------------------ SGLang stand-ins
@dataclass(frozen=True)
class GroupShape:
    """What SGLang's PD managers read of a ``GroupCoordinator`` (size and rank): the real
    coordinator builds device communicators; the PD collectives use the gloo groups."""

    world_size: int
    rank_in_group: int


def install_parallel_state(cp_size: int, cp_rank: int) -> None:
    """SGLang's parallel state of an NSA prefill CP rank (attention TP 1, CP ``cp_size``,
    attention DP 1, PP 1), or of the decode server with ``cp_size`` 1."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    parallel_state._ATTN_TP = GroupShape(1, 0)
    parallel_state._ATTN_CP = GroupShape(cp_size, cp_rank)
    parallel_state._PP = GroupShape(1, 0)
    dp_attention._ATTN_DP_SIZE, dp_attention._ATTN_DP_RANK = 1, 0


def pd_server_args(mode: str, cp_size: int, bootstrap_port: int, draft: bool):
    """The ``ServerArgs`` a PD server of ``mode`` launches with (prefill: the plugin's flag
    on, NSA prefill CP as SGLang lays it out: tp = cp, dp attention, dp 1)."""
    from sglang.srt.server_args import ServerArgs

    common = dict(
        model_path="dummy",
        host=LOOPBACK,
        page_size=PAGE_SIZE,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
        speculative_algorithm="NEXTN" if draft else None,
    )
    if mode == "decode":
        return ServerArgs(**common)
    return ServerArgs(
        **common,
        tp_size=cp_size,
        dp_size=1,
        enable_dp_attention=True,
        enable_nsa_prefill_context_parallel=True,
        attn_cp_size=cp_size,
        enable_nsa_prefill_cp_shared_kv=True,
        enable_hierarchical_cache=True,
    )


@dataclass
class PrefillSchedulerFields:
    """The ``Scheduler`` fields upstream's ``PrefillBootstrapQueue`` and prefill mixin
    (``send_kv_chunk``) read."""

    server_args: Any
    tree_cache: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    attn_cp_cpu_group: Any
    attn_tp_cpu_group: Any
    disagg_metadata_buffers: Any
    model_config: Any
    tp_worker: Any = field(default_factory=lambda: SimpleNamespace(is_hybrid_swa=False))
    dp_rank: Optional[int] = None
    gpu_id: int = 0
    enable_metrics: bool = False
    enable_hicache_storage: bool = False
    sliding_window_size: Optional[int] = None
    disagg_prefill_bootstrap_queue: Any = None

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        """To the client: the harness reads each request's outcome from the request."""


@dataclass
class DecodeSchedulerFields:
    """The ``Scheduler`` fields upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` read."""

    server_args: Any
    model_config: Any
    spec_algorithm: Any
    running_batch: Any = field(default_factory=lambda: SimpleNamespace(reqs=[]))
    waiting_queue: List[Any] = field(default_factory=list)
    last_batch: Any = None
    tp_worker: Any = field(default_factory=lambda: SimpleNamespace(is_hybrid_swa=False))
    dp_rank: Optional[int] = None
    gpu_id: int = 0
    enable_hisparse: bool = False
    enable_metrics: bool = False
    enable_priority_scheduling: bool = False
    sliding_window_size: Optional[int] = None

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        """To the client: the harness reads each request's outcome from the request."""


# ------------------------------------------------------------------ negative controls
def _wrong_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Optional[Callable[..., Any]]:
    """The broken KV owner filter ``plant`` gives this prefill rank (None: it keeps the right one)."""
    if plant is None:
        return None
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    right = utils.filter_kv_indices_for_shared_kv
    if plant == "wrong_owner":
        # Pages of the next rank's lane, read from this rank's slots of the same ids.
        def wrong(layout, kv_indices, index_slice):
            shifted = CpSharedKVLayout(layout.cp_size, (layout.cp_rank + 1) % layout.cp_size, layout.page_size)
            return right(shifted, kv_indices, index_slice)

        return wrong
    if cp_rank == cp_size - 1:  # rank_skips_send: the last rank sends no pages

        def skip(layout, kv_indices, index_slice):
            src, dst = right(layout, kv_indices, index_slice)
            return src[:0], dst[:0]

        return skip
    return None


def plant_bug(plant: Optional[str], cp_rank: int, cp_size: int) -> None:
    """Break this prefill rank's KV owner filter as ``plant`` says, for good (the simulator's fault)."""
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    wrong = _wrong_filter(plant, cp_rank, cp_size)
    if wrong is not None:
        utils.filter_kv_indices_for_shared_kv = wrong


@contextlib.contextmanager
def planted_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Iterator[None]:
    """Within the block, this prefill rank's KV owner filter is broken as ``plant`` says;
    restored after (the block ends once the request's transfer polled Success or Failed)."""
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    right, wrong = utils.filter_kv_indices_for_shared_kv, _wrong_filter(plant, cp_rank, cp_size)
    if wrong is None:
        yield
        return
    utils.filter_kv_indices_for_shared_kv = wrong
    try:
        yield
    finally:
        utils.filter_kv_indices_for_shared_kv = right


# ------------------------------------------------------------------ pools
def _pool_buffers(pools: List[Any]) -> List[torch.Tensor]:
    """Every device buffer a PD transfer touches: per layer, MLA KV and NSA indexer K/scale."""
    buffers = []
    for pool in pools:
        if pool is None:
            continue
        buffers += list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer)
    return buffers


def _host_buffers(cache: Any) -> List[torch.Tensor]:
    """The host tier's bytes: every host pool of the CP host group (MLA KV, NSA indexer),
    and of its MTP draft group."""
    groups = [cache.token_to_kv_pool_host, getattr(cache.token_to_kv_pool_host, "draft", None)]
    buffers = []
    for group in (g for g in groups if g is not None):
        for entry in group.entries:
            for name in ("kv_buffer", "index_k_with_scale_buffer"):
                if hasattr(entry.host_pool, name):
                    buffers.append(getattr(entry.host_pool, name))
    return buffers


def _page_rows(buffer: torch.Tensor, num_pages: int) -> torch.Tensor:
    """A paged pool buffer as uint8 rows, one per page (the KV buffer holds a page's
    tokens in consecutive rows, the NSA indexer buffer one row per page)."""
    raw = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
    return raw.reshape(num_pages, -1)


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
    def _resources(self) -> Dict[str, int]:
        """What a finished request must give back: free + evictable KV (logical), request
        slots, metadata slots, and no locked tree tokens."""
        cache = self.stack.cache
        return {
            "kv_free_or_evictable": self.stack.allocator.available_size() + cache.evictable_size(),
            "req_slots": self.stack.req_to_token_pool.available_size(),
            "metadata_slots": self.metadata_allocator.available_size(),
            "locked_tokens": cache.protected_size(),
        }

    def _snapshot(self) -> List[torch.Tensor]:
        pools = _pool_buffers([self.stack.kv_pool, self.stack.draft_pool])
        return [b.clone() for b in pools + _host_buffers(self.stack.cache)]

    def _unchanged(self, snapshot: List[torch.Tensor]) -> bool:
        pools = _pool_buffers([self.stack.kv_pool, self.stack.draft_pool])
        return all(torch.equal(a, b) for a, b in zip(snapshot, pools + _host_buffers(self.stack.cache)))

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
        aux_bytes = sum(self.kv_manager.kv_args.aux_item_lens) if out.success else 0
        out.payload_bytes = self.meter.total - bytes_before - aux_bytes
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
        aux_bytes = sum(self.kv_manager.kv_args.aux_item_lens) if out.success else 0
        out.payload_bytes = self.meter.total - bytes_before - aux_bytes
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
        channel.event(REGISTERED)
        hold_if_asked(channel, scenario)
        outcomes = []
        for step in scenario.steps:
            if isinstance(step, EvictDevice):
                server.evict_device()
            elif step.bootstrap_port is None:  # requests to another bootstrap never reach prefill
                with planted_filter(scenario.plant_for(step.rid), rank, scenario.cp_size):
                    outcomes.append(server.serve(channel, step))
        return outcomes


# ------------------------------------------------------------------ decode
class DecodeServer(DecodeChecks):
    """The decode server: a full (cp 1) NSA pool under upstream's PD decode queues."""

    page_size = PAGE_SIZE

    def __init__(self, scenario: PDScenario, ports: PDPorts):
        from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

        self.scenario, self.ports, self.ns = scenario, ports, nsa_stack
        self.stack = self._build_stack()
        self.pools = [p for p in (self.stack.kv_pool, self.stack.draft_pool) if p is not None]
        self._scatter_free_pages(np.random.default_rng(scenario.seed))
        self._fill_sentinel()
        self.server_args = pd_server_args("decode", 1, ports.bootstrap, scenario.draft)
        self.errors = ErrorLog()
        init_transfer_engine()
        self.prealloc_queue, self.transfer_queue = self._build_queues()
        self.granted: set = set()
        self.served: List[Tuple[PDRequest, Any]] = []
        self.planted: List[Tuple[PDRequest, Any]] = []

    def _build_stack(self) -> Any:
        """Pools, allocator and request slots of an unsharded decode (``nsa_stack``'s
        reference checks read it with layout None: every token)."""
        from sglang.srt.mem_cache import allocator as allocator_module
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch

        allocator_module.alloc_extend_kernel = NaiveExtendLaunch()  # Triton has no CPU backend
        cfg = self.ns.StackConfig(
            cp_size=1, layer_num=self.scenario.layer_num, page_size=PAGE_SIZE,
            physical_tokens=PAGE_SIZE * self.scenario.decode_pages,
        )  # fmt: skip
        kv_pool = self.ns.build_kv_pool(cfg)
        draft_pool = self.ns.build_kv_pool(cfg, layer_num=self.ns.DRAFT_LAYERS) if self.scenario.draft else None
        allocator = PagedTokenToKVPoolAllocator(cfg.physical_tokens, PAGE_SIZE, torch.bfloat16, "cpu", kv_pool, need_sort=False)
        req_to_token_pool = ReqToTokenPool(32, cfg.max_context_len, device="cpu", enable_memory_saver=False)
        return self.ns.RankStack(None, allocator, kv_pool, req_to_token_pool, None, draft_pool)

    def _build_queues(self) -> Tuple[Any, Any]:
        """Upstream's decode queues over this stack (their ``MooncakeKVManager`` inside)."""
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_cp_hicache.testing.dist import single_rank_world

        stack, world = self.stack, single_rank_world()  # the decode's TP group: one rank
        fields = DecodeSchedulerFields(
            server_args=self.server_args,
            model_config=SimpleNamespace(num_hidden_layers=self.scenario.layer_num),
            # SGLang resolves NEXTN to EAGLE when it parses the server args.
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if self.scenario.draft else None),
        )
        self.metadata_buffers = MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16)
        metadata_allocator = ReqToMetadataIdxAllocator(8)
        self.tree_cache = tree_cache = ChunkCache(
            CacheInitParams(
                disable=True, req_to_token_pool=stack.req_to_token_pool,
                token_to_kv_pool_allocator=stack.allocator, page_size=PAGE_SIZE,
            )
        )  # fmt: skip
        transfer_queue = DecodeTransferQueue(
            gloo_group=world, req_to_metadata_buffer_idx_allocator=metadata_allocator, tp_rank=0,
            metadata_buffers=self.metadata_buffers, scheduler=fields, tree_cache=tree_cache,
        )  # fmt: skip
        prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=stack.req_to_token_pool, token_to_kv_pool_allocator=stack.allocator,
            draft_token_to_kv_pool=stack.draft_pool, req_to_metadata_buffer_idx_allocator=metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=fields, transfer_queue=transfer_queue,
            tree_cache=tree_cache, gloo_group=world, tp_rank=0, tp_size=1, dp_size=1, gpu_id=0,
            bootstrap_port=self.ports.bootstrap, max_total_num_tokens=stack.allocator.size, pp_rank=0,
            num_reserved_decode_tokens=0, transfer_backend=TransferBackend.MOONCAKE,
        )  # fmt: skip
        # Upstream tries an unreachable bootstrap 15 times, 1 s apart; 3 keep the fault short.
        prealloc_queue._max_ensure_retries = 3
        return prealloc_queue, transfer_queue

    def _scatter_free_pages(self, rng: np.random.Generator) -> None:
        """A decode server that has served before: its free pages in no particular order."""
        allocator = self.stack.allocator
        locs = allocator.alloc(allocator.available_size())
        for page in rng.permutation(len(locs) // PAGE_SIZE):
            allocator.free(locs[page * PAGE_SIZE : (page + 1) * PAGE_SIZE])

    def _fill_sentinel(self) -> None:
        for buffer in _pool_buffers(self.pools):
            (buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer).fill_(SENTINEL_BYTE)

    def _changed_pages(self) -> np.ndarray:
        """Per page, whether any pool byte differs from the sentinel."""
        num_pages = self.scenario.decode_pages + 1  # page 0 is the pool's padding page
        changed = torch.zeros(num_pages, dtype=torch.bool)
        for buffer in _pool_buffers(self.pools):
            changed |= (_page_rows(buffer, num_pages) != SENTINEL_BYTE).any(dim=1)
        return changed.numpy()

    def _locs(self, req: Any, n: int) -> torch.Tensor:
        return self.stack.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    def _mismatches(self, spec: PDRequest, locs: torch.Tensor) -> Tuple[int, int]:
        ids, pos = torch.tensor(spec.token_ids), torch.arange(len(spec.token_ids))
        target = self.ns.count_kv_mismatches(self.stack, locs, ids, pos)
        draft = self.ns.count_draft_kv_mismatches(self.stack, locs, ids, pos) if self.scenario.draft else 0
        return target, draft

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the decode server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=list(spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host=LOOPBACK,
            bootstrap_port=spec.bootstrap_port or self.ports.bootstrap, bootstrap_room=spec.room,
        )  # fmt: skip

    def _release(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree_cache, is_insert=False)

    def _keep(self, spec: PDRequest, locs: torch.Tensor, req: Any) -> None:
        kept = self.served if self.scenario.plant_for(spec.rid) is None else self.planted
        kept.append((spec, locs))

    def _aux_ok(self, spec: PDRequest, req: Any) -> bool:
        if req.output_ids != [spec.next_token]:
            return False
        if not self.scenario.draft:
            return True
        return torch.equal(req.hidden_states_tensor, expected_hidden_state(spec))

def decode_role(channel: RoleChannel, scenario: PDScenario, ports: PDPorts, rids: Optional[List[str]] = None) -> DecodeReport:
    """Role: the decode server; serves the scenario's requests (or only ``rids``)."""
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch

    load_plugins()  # pip-installed beside SGLang on the decode server too (its flag is off)
    install_parallel_state(1, 0)
    with scheduler_batch.cpu_scheduler_server_args(PAGE_SIZE):
        server = DecodeServer(scenario, ports)
        channel.event("ready")
        outcomes = []
        for spec in scenario.requests:
            if rids is None or spec.rid in rids:
                outcomes.append(server.serve(spec))
        return server.report(outcomes)


#: This line's roles for the line-agnostic cluster runners of ``testing.pd``
#: (``run_pd_cluster``, ``run_fault_cluster``, ``prefill_startup_failure``).
LINE = PDLine(prefill_role=prefill_rank_role, decode_role=decode_role)


__all__ = [
    "LINE",
    "DecodeOutcome",
    "DecodeReport",
    "EvictDevice",
    "PDRequest",
    "PDScenario",
    "PLANTS",
    "PrefillOutcome",
    "planted_filter",
    "decode_role",
    "prefill_rank_role",
]
