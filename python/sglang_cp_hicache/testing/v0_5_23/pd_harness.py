"""The 0.5.23 line's PD roles: sharded prefill CP ranks and one decode server, real bytes end to end.

Each prefill rank (one process, gloo CP group) is upstream 0.5.23's real sharded DSA HiCache
stack with the plugin's flag (:func:`~sglang_cp_hicache.testing.v0_5_23.stack.build_sharded_stack`,
``StackConfig(cp_shared_kv=True)``: ``PageInterleaveDSATokenToKVPool``,
``PageInterleavePoolAllocator``, ``UnifiedRadixCache`` with a ``PageInterleaveHostPool``)
under upstream's own PD prefill code: ``PrefillBootstrapQueue`` (its ``MooncakeKVManager``
builds ``KVArgs`` from the sharded pool and registers ``enable_kv_cache_sharding`` with the
bootstrap server), ``pop_bootstrapped`` all-reduced over CP, upstream's ``send_kv_chunk``
per chunk (its ``MooncakeKVSender`` owner-filters the pages with
``filter_kv_indices_for_shard_rank``, the DSA indexer pages with
``_prepare_sharded_dsa_indices``), the CP-all-reduced poll. The harness drives the cache as
the scheduler's admission does, through the stack's own calls (prefix match, host load-back,
``alloc_extend`` continuing the chain's rotation, insert after the transfer); a forward's
stores are a deterministic pattern written into the rows the rank owns.

The decode server (cp 1, one process) holds a full, unsharded ``DSATokenToKVPool`` under
upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` (``MooncakeKVReceiver``): its
free pages scattered, its bytes a sentinel. After each transfer it checks, byte for byte
against the pattern (what a replicated prefill holds), every token's MLA KV row and DSA
indexer K/scale, and at the end that no page outside the ones it granted changed.

With ``PDScenario.draft`` each prefill rank also holds the MTP draft's one-layer sharded pool
(:func:`build_draft_pool`, as upstream's ``_build_mtp_kv_shard_pool`` builds it) and the decode
a one-layer draft pool under EAGLE; the draft's KV and indexer are checked the same way.

Stand-ins only where a model or a GPU is needed: the ``Scheduler`` objects
(:class:`PrefillSchedulerFields`, :class:`DecodeSchedulerFields` carry exactly what
upstream's PD code reads of them), and the runtime context's parallel groups (gloo).

Entry points (stable names):

* :data:`LINE` -- this line's roles for ``testing.pd``'s line-agnostic runners
  (``run_pd_cluster(LINE, scenario)``: one scenario on a fresh cluster, bootstrap,
  ``cp_size`` prefill rank processes, one decode, every process ended on return);
* :func:`prefill_rank_role` / :func:`decode_role` -- the roles, for a
  :class:`~sglang_cp_hicache.testing.pd.PDCluster` a caller arranges itself (faults);
* in-process, for another harness that already runs the prefill ranks (the simulator's
  ``--pd``), in each rank process (``os.environ.update(role_env(PDEnv()))`` before the KV
  manager is built; the CP group of a :class:`~sglang_cp_hicache.testing.dist.RankContext`):
  ``PrefillRank(ctx, scenario, ports, stack=its_sharded_stack)``, then per finished request
  :meth:`PrefillRank.send_prefilled` (the caller's ``req_to_token`` row, its KV already
  stored; no cache call; every rank, same order), or :meth:`PrefillRank.serve` (the harness
  runs the request's admission, stores, send, insert and release itself). The bootstrap and
  the decode run in a ``PDCluster`` of the caller's (its ``ports``):
  ``DecodeServer(scenario, ports, pattern=...)`` then :meth:`DecodeServer.serve` per request
  (``keep=False`` gives each request's pages back once checked). The decode checks bytes
  against a :class:`KVPattern`: the caller's own (``HARNESS_PATTERN``, what
  :func:`write_owned_kv` stores, by default).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from sglang_cp_hicache.testing.pd import (
    LOOPBACK,
    SENTINEL_BYTE,
    DecodeChecks,
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

PAGE_SIZE = 64  # DSA's indexer pages
INDEX_KEY_BYTES = 128  # fp8 indexer key per token
INDEX_SCALE_BYTES = 4  # fp32 scale per token
HIDDEN_SIZE = 64  # the metadata buffers' hidden state
DRAFT_LAYERS = 1  # one NextN layer (what upstream's sharded MTP admits)
#: Where upstream's owner filter is bound by name (KV pages; DSA indexer pages).
_FILTER_MODULES = ("sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.mooncake.conn")


# ------------------------------------------------------------------ scenario
@dataclass(frozen=True)
class PDScenario(ScenarioSteps):
    """What every role of one 0.5.23 cluster runs.

    ``plants`` (negative controls) maps a request id to a bug planted in upstream's owner
    filter on the prefill ranks while that request is served: ``wrong_owner`` makes each
    rank pick the next rank's lane (its local ids, read from its own rows);
    ``rank_skips_send`` makes the last rank send no pages (it still reports). The decode
    re-checks a planted request at the end apart from the others
    (``final_planted_kv_mismatches``).
    ``pause_after_chunk`` names a request whose prefill ranks stop after their first chunk
    until the harness answers the ``chunk-sent`` checkpoint (the decode-killed fault).
    ``hold_after_registering``: the prefill ranks wait for the harness's ``go`` once
    registered (the fault cluster's decodes start meanwhile).
    ``draft``: the MTP draft's one-layer sharded pool beside the target on every prefill
    rank (upstream's ``num_draft_entries``), and its KV checked on the decode. The draft is
    not in the stack's host tier (``build_sharded_stack`` has no PACKED draft host layers),
    so a draft scenario must not take a prefix from a host load-back.
    """

    cp_size: int
    steps: Tuple[Step, ...]
    draft: bool = False
    layer_num: int = 2
    prefill_pages_per_rank: int = 24
    decode_pages: int = 96
    plants: Tuple[Tuple[str, str], ...] = ()
    pause_after_chunk: Optional[str] = None
    hold_after_registering: bool = False
    transfer_timeout_s: float = 60.0
    seed: int = 0
    context_len: int = 2048  # the longest prompt a rank's and the decode's request rows hold

    def __post_init__(self) -> None:
        self.check_plants()
        if self.cp_size < 2:
            raise ValueError("the 0.5.23 PD harness shards KV: cp_size must be >= 2")
        if self.draft and any(isinstance(step, EvictDevice) for step in self.steps):
            raise ValueError("a draft scenario cannot load back from host: the draft has no host layers")

    def stack_config(self) -> Any:
        """One prefill rank's ``StackConfig`` (the plugin's flag on)."""
        from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig

        return StackConfig(
            page_size=PAGE_SIZE,
            layer_num=self.layer_num,
            device_pages_per_rank=self.prefill_pages_per_rank,
            context_len=self.context_len,
            chunk_tokens=1024,
            max_num_reqs=8,
            max_prefix_tokens=2048,
            cp_shared_kv=True,
        )


# ------------------------------------------------------------------ the byte pattern
def kv_pattern(token_ids: torch.Tensor, positions: torch.Tensor, layer: int, dim: int) -> torch.Tensor:
    """The MLA KV row ``[n, 1, dim]`` a forward stores for each (token, position) on
    ``layer`` (bf16-exact small integers)."""
    base = (token_ids * 7 + positions * 13 + layer * 31)[:, None] + torch.arange(dim)[None]
    return ((base % 251) - 125).to(torch.bfloat16).unsqueeze(1)


def index_pattern(token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """Each token's DSA indexer bytes ``[n, 132]`` on ``layer``: fp8 key then fp32 scale."""
    width = INDEX_KEY_BYTES + INDEX_SCALE_BYTES
    base = (token_ids * 5 + positions * 11 + layer * 17)[:, None] + torch.arange(width)[None] * 3
    return (base % 256).to(torch.uint8)


@dataclass(frozen=True)
class KVPattern:
    """What a forward stores per token, the reference every decode-side check reads:
    ``kv(token_ids, positions, layer, dim)`` -> MLA KV rows ``[n, 1, dim]`` (bf16);
    ``index(token_ids, positions, layer)`` -> DSA indexer bytes ``[n, 132]`` (uint8, key
    then scale); the draft's layers are ``draft_first_layer + i``."""

    kv: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    index: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    draft_first_layer: int = 100


#: The harness's own pattern (what :func:`write_owned_kv` stores by default).
HARNESS_PATTERN = KVPattern(kv=kv_pattern, index=index_pattern)


def _index_offsets(locs: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page row, byte offsets [n, 132]) of each token slot in the packed indexer page
    (``page_size`` keys of 128 B, then ``page_size`` scales of 4 B)."""
    page, slot = locs // page_size, locs % page_size
    keys = slot[:, None] * INDEX_KEY_BYTES + torch.arange(INDEX_KEY_BYTES)[None]
    scales = page_size * INDEX_KEY_BYTES + slot[:, None] * INDEX_SCALE_BYTES + torch.arange(INDEX_SCALE_BYTES)[None]
    return page, torch.cat([keys, scales], dim=1)


def store_tokens(
    pool: Any,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    first_layer: int = 0,
    pattern: KVPattern = HARNESS_PATTERN,
) -> None:
    """A forward's stores into ``pool``'s own (physical) ``rows``: KV and indexer, every
    layer (``first_layer``: the pattern's layer of the pool's layer 0)."""
    if len(rows) == 0:
        return
    dim = pool.kv_buffer[0].shape[-1]
    page, offsets = _index_offsets(rows, pool.page_size)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][rows] = pattern.kv(token_ids, positions, first_layer + layer, dim)
        index = pattern.index(token_ids, positions, first_layer + layer)
        pool.index_k_with_scale_buffer[layer][page[:, None], offsets] = index


def count_kv_mismatches(
    pool: Any,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    first_layer: int = 0,
    pattern: KVPattern = HARNESS_PATTERN,
) -> int:
    """Tokens whose KV row or indexer bytes in ``pool`` at ``rows`` differ from the pattern."""
    if len(rows) == 0:
        return 0
    dim = pool.kv_buffer[0].shape[-1]
    page, offsets = _index_offsets(rows, pool.page_size)
    bad = torch.zeros(len(rows), dtype=torch.bool)
    for layer in range(pool.layer_num):
        kv = pool.kv_buffer[layer][rows]
        expected = pattern.kv(token_ids, positions, first_layer + layer, dim)
        bad |= (kv.view(torch.uint8) != expected.view(torch.uint8)).flatten(1).any(1)
        index = pool.index_k_with_scale_buffer[layer][page[:, None], offsets]
        bad |= (index != pattern.index(token_ids, positions, first_layer + layer)).any(1)
    return int(bad.sum())


def write_owned_kv(
    stack: Any, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, draft_pool: Any = None
) -> None:
    """What a sharded forward stores: the tokens whose logical slot this rank owns, at their
    physical rows (``stack`` a :class:`~sglang_cp_hicache.testing.v0_5_23.stack.RankStack`),
    in the target pool and, given, the MTP draft's (same logical slots, same owners)."""
    owned = stack.owned_mask(logical_locs)
    rows, ids, pos = stack.physical_rows(logical_locs), token_ids[owned], positions[owned]
    store_tokens(stack.kv_pool, rows, ids, pos)
    if draft_pool is not None:
        store_tokens(draft_pool, rows, ids, pos, first_layer=HARNESS_PATTERN.draft_first_layer)


def build_draft_pool(stack: Any) -> Any:
    """The MTP draft's sharded pool beside ``stack``'s target, as upstream builds it
    (``KVCacheConfigurator._build_mtp_kv_shard_pool``): one layer, the target's shard spec,
    shard group and geometry, its own latent and indexer buffers; it shares the target's
    logical allocator (so its owners)."""
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    target, cfg = stack.kv_pool, stack.config
    return PageInterleaveDSATokenToKVPool(
        size=target.size, page_size=target.page_size, dtype=cfg.dtype, layer_num=DRAFT_LAYERS,
        device="cpu", enable_memory_saver=False, shard_spec=target.shard_spec,
        shard_group=target.shard_group, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, kv_cache_dim=target.kv_cache_dim,
        index_head_dim=cfg.index_head_dim, index_kpool=1,
    )  # fmt: skip


def expected_hidden_state(spec: PDRequest) -> torch.Tensor:
    """The MTP hidden state prefill carries for ``spec`` (bf16-exact small integers)."""
    return ((torch.arange(HIDDEN_SIZE) + spec.next_token) % 97 - 48).to(torch.bfloat16)


def _pool_buffers(pool: Any) -> List[torch.Tensor]:
    return list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer)


def _as_bytes(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer


# ------------------------------------------------------------------ negative controls
@contextlib.contextmanager
def planted_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Iterator[None]:
    """Within the block, upstream's owner filter on this prefill rank is broken as ``plant``
    says (both names it is bound by: KV pages and DSA indexer pages); restored after."""
    modules = [importlib.import_module(name) for name in _FILTER_MODULES]
    right = modules[0].filter_kv_indices_for_shard_rank
    wrong = None
    if plant == "wrong_owner":

        def wrong(*, kv_indices, index_slice, shard_rank, shard_size):
            next_rank = (shard_rank + 1) % shard_size
            return right(kv_indices=kv_indices, index_slice=index_slice, shard_rank=next_rank, shard_size=shard_size)

    elif plant == "rank_skips_send" and cp_rank == cp_size - 1:

        def wrong(*, kv_indices, index_slice, shard_rank, shard_size):
            local, positions = right(
                kv_indices=kv_indices, index_slice=index_slice, shard_rank=shard_rank, shard_size=shard_size
            )
            return local[:0], positions[:0]

    if wrong is None:
        yield
        return
    for module in modules:
        module.filter_kv_indices_for_shard_rank = wrong
    try:
        yield
    finally:
        for module in modules:
            module.filter_kv_indices_for_shard_rank = right


# ------------------------------------------------------------------ runtime context
def publish_pd_record(mode: str, bootstrap_port: int, config: Any = None) -> Any:
    """Publish the ``ServerArgs`` a PD server of ``mode`` runs with: prefill, the sharded
    stack's record plus the PD fields, and the plugin's flag where the stack has it
    (``config.cp_shared_kv``; off: upstream's native sharding alone); decode, a plain cp-1
    record."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    fields = dict(
        model_path="dummy",
        host=LOOPBACK,
        page_size=PAGE_SIZE,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
    )
    if mode == "prefill":
        fields.update(
            context_length=config.context_len,
            chunked_prefill_size=config.chunk_tokens,
            hicache_ratio=config.host_to_device_ratio,
            hicache_io_backend=config.io_backend,
            hicache_mem_layout=config.mem_layout,
            hicache_write_policy=config.write_policy,
            hicache_host_memory_mode="cache",
            enable_kv_cache_sharding=True,
            enable_prefill_cp=True,
            cp_strategy="interleave",
        )
    server_args = ServerArgs(**fields)
    if mode == "prefill" and config.cp_shared_kv:
        from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

        set_cp_shared_kv_enabled(server_args, True)
    set_global_server_args_for_scheduler(server_args)
    return server_args


def stamp_parallel(cp_size: int, cp_rank: int, cp_group: Any, tp_group: Any) -> None:
    """The parallel state of a prefill CP rank (attention TP 1, CP ``cp_size``, PP 1) or,
    with ``cp_size`` 1, of the decode server; groups are gloo (``cpu_group``)."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    def group(pg: Any, size: int, rank: int) -> GlooShardGroup:
        return GlooShardGroup(world_size=size, rank_in_group=rank, cpu_group=pg)

    values = dict(
        tp_size=cp_size, tp_rank=cp_rank, moe_tp_size=cp_size, attn_tp_size=1, attn_tp_rank=0,
        attn_tp_group=group(tp_group, 1, 0), pp_size=1, pp_rank=0, pp_group=group(tp_group, 1, 0),
        attn_dp_size=1, attn_dp_rank=0, dp_rank=0,
    )  # fmt: skip
    values.update(attn_cp_size=cp_size, attn_cp_rank=cp_rank, attn_cp_group=group(cp_group, cp_size, cp_rank))
    get_parallel().override_permanently(**values)


# ------------------------------------------------------------------ scheduler stand-ins
@dataclass
class PrefillSchedulerFields:
    """What upstream's ``PrefillBootstrapQueue`` and prefill mixin (``send_kv_chunk``) read
    of the ``Scheduler``."""

    server_args: Any
    tree_cache: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    attn_cp_cpu_group: Any
    attn_tp_cpu_group: Any
    disagg_metadata_buffers: Any
    req_to_metadata_buffer_idx_allocator: Any
    model_config: Any
    tp_worker: Any
    kv_shard_widening: int
    rust_server: Any = None
    enable_staging: bool = False
    enable_overlap: bool = False
    kv_checksum_computer: Any = None
    processed_tokens_counter: int = 0
    disagg_prefill_bootstrap_queue: Any = None
    disagg_prefill_pending_chunk_rids: Set[str] = field(default_factory=set)
    output_streamer: Any = field(default_factory=lambda: SimpleNamespace(stream_output=lambda *a, **k: None))

    def retire_unadmitted_request(self, req: Any) -> None:
        raise RuntimeError(f"prefill: {req.rid} rejected at intake")

    def handle_bootstrap_failure(self, req: Any) -> None:
        """The scheduler's reaction to a Failed bootstrap poll: the request ends aborted
        (the harness frees what it holds and reads the reason)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        try:
            req.disagg_kv_sender.failure_exception()
            reason = "bootstrap failed"
        except Exception as error:  # upstream raises the recorded reason
            reason = str(error)
        req.finished_reason = FINISH_ABORT(reason)


@dataclass
class DecodeSchedulerFields:
    """What upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` read of the ``Scheduler``."""

    server_args: Any
    model_config: Any
    spec_algorithm: Any
    tp_worker: Any
    running_batch: Any = field(default_factory=lambda: SimpleNamespace(reqs=[]))
    waiting_queue: List[Any] = field(default_factory=list)
    last_batch: Any = None
    enable_hisparse: bool = False
    enable_decode_hicache: bool = False
    enable_priority_scheduling: bool = False
    enable_lora: bool = False
    hisparse_coordinator: Any = None
    kv_checksum_computer: Any = None
    random_seed: int = 0
    sliding_window_size: Optional[int] = None
    disagg_decode_prealloc_queue: Any = None
    metrics_reporter: Any = field(default_factory=lambda: SimpleNamespace(enable_metrics=False))
    metrics_collector: Any = None
    output_streamer: Any = field(default_factory=lambda: SimpleNamespace(stream_output=lambda *a, **k: None))
    # The handoff token's reasoning accounting (no reasoning parser here).
    batch_result_processor: Any = field(
        default_factory=lambda: SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None)
    )

    def retire_unadmitted_request(self, req: Any) -> None:
        raise RuntimeError(f"decode: {req.rid} rejected at intake")


def _model_config(layer_num: int) -> Any:
    return SimpleNamespace(
        num_hidden_layers=layer_num,
        hf_text_config=SimpleNamespace(),
        get_total_num_kv_heads=lambda: 1,
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
            model_config=_model_config(scenario.layer_num),
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
    def _resources(self) -> Dict[str, int]:
        """What a finished request must give back: free (every owner class, not the
        min-class admission floor) + evictable logical KV, request slots, metadata slots,
        and no locked tree tokens."""
        cache = self.stack.cache
        return {
            "kv_free_or_evictable": self.stack.allocator.aggregate_free_size() + cache.evictable_size(),
            "req_slots": self.stack.req_to_token_pool.available_size(),
            "metadata_slots": self.metadata_allocator.available_size(),
            "locked_tokens": cache.protected_size(),
        }

    def _tier_buffers(self) -> List[torch.Tensor]:
        """This rank's device pool and host tier (KV anchor and DSA indexer host pools)."""
        host = [entry.host_pool for entry in self.stack.host_pool_group.entries]
        names = ("kv_buffer", "index_k_with_scale_buffer")
        host_buffers = [getattr(pool, name) for pool in host for name in names if hasattr(pool, name)]
        device = _pool_buffers(self.stack.kv_pool)
        if self.draft_pool is not None:
            device += _pool_buffers(self.draft_pool)
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
        for buffer in _pool_buffers(self.stack.kv_pool):
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
        aux_bytes = sum(self.kv_manager.kv_args.aux_item_lens) if out.success else 0
        out.payload_bytes = self.meter.total - bytes_before - aux_bytes
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
        aux_bytes = sum(self.kv_manager.kv_args.aux_item_lens) if out.success else 0
        out.payload_bytes = self.meter.total - bytes_before - aux_bytes
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
    channel.event(REGISTERED)
    hold_if_asked(channel, scenario)
    outcomes = []
    for step in scenario.steps:
        if isinstance(step, EvictDevice):
            server.evict_device()
        elif step.bootstrap_port is None:  # requests to another bootstrap never reach prefill
            with planted_filter(scenario.plant_for(step.rid), rank, scenario.cp_size):
                outcomes.append(server.serve(channel, step))
    server.stack.close()
    return outcomes


# ------------------------------------------------------------------ decode
class DecodeServer(DecodeChecks):
    """The decode server: a full (cp 1) ``DSATokenToKVPool`` under upstream's PD decode queues."""

    page_size = PAGE_SIZE

    def __init__(self, scenario: PDScenario, ports: PDPorts, pattern: KVPattern = HARNESS_PATTERN):
        """``scenario`` gives the geometry (``layer_num``, ``decode_pages``, ``draft``);
        ``pattern`` is what the prefill side stored (the check's reference)."""
        self.scenario, self.ports, self.pattern = scenario, ports, pattern
        self.server_args = publish_pd_record("decode", ports.bootstrap)
        from sglang_cp_hicache.testing.dist import single_rank_world

        world = single_rank_world()
        stamp_parallel(1, 0, world, world)
        self.kv_pool, self.draft_pool, self.allocator, self.req_to_token_pool, self.tree_cache = self._build_stack()
        self._scatter_free_pages(np.random.default_rng(scenario.seed))
        for buffer in self._buffers():
            _as_bytes(buffer).fill_(SENTINEL_BYTE)
        self.errors = ErrorLog()
        init_transfer_engine()
        self.prealloc_queue, self.transfer_queue = self._build_queues()
        self.granted: set = set()
        self.served: List[Tuple[PDRequest, torch.Tensor]] = []
        self.planted: List[Tuple[PDRequest, torch.Tensor]] = []

    def _buffers(self) -> List[torch.Tensor]:
        pools = [self.kv_pool] + ([self.draft_pool] if self.draft_pool is not None else [])
        return [b for pool in pools for b in _pool_buffers(pool)]

    def _build_stack(self) -> Tuple[Any, Any, Any, Any, Any]:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cfg = self.scenario.stack_config()
        size = PAGE_SIZE * self.scenario.decode_pages
        def pool(layer_num: int) -> Any:
            return DSATokenToKVPool(
                size, page_size=PAGE_SIZE, kv_lora_rank=cfg.kv_lora_rank, dtype=cfg.dtype,
                qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=layer_num, device="cpu",
                index_head_dim=cfg.index_head_dim, enable_memory_saver=False, kv_cache_dim=cfg.kv_cache_dim,
            )  # fmt: skip

        kv_pool = pool(cfg.layer_num)
        draft_pool = pool(DRAFT_LAYERS) if self.scenario.draft else None
        allocator = PagedTokenToKVPoolAllocator(
            size, page_size=PAGE_SIZE, dtype=cfg.dtype, device="cpu", kvcache=kv_pool, need_sort=False
        )
        req_to_token_pool = ReqToTokenPool(
            size=32, max_context_len=cfg.context_len, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            disable=True, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
            page_size=PAGE_SIZE, tree_components=(ComponentType.FULL,),
        )  # fmt: skip
        return kv_pool, draft_pool, allocator, req_to_token_pool, UnifiedRadixCache(params=params)

    def _build_queues(self) -> Tuple[Any, Any]:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.fields = DecodeSchedulerFields(
            server_args=self.server_args,
            model_config=_model_config(self.scenario.layer_num),
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if self.scenario.draft else None),
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")
            ),
        )
        self.metadata_buffers = MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16, 0)
        metadata_allocator = ReqToMetadataIdxAllocator(8)
        transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=metadata_allocator, metadata_buffers=self.metadata_buffers,
            scheduler=self.fields, tree_cache=self.tree_cache,
        )  # fmt: skip
        prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=self.draft_pool, req_to_metadata_buffer_idx_allocator=metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.fields, transfer_queue=transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0, bootstrap_port=self.ports.bootstrap,
            max_total_num_tokens=self.allocator.size, num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.MOONCAKE,
        )  # fmt: skip
        self.fields.disagg_decode_prealloc_queue = prealloc_queue
        # Upstream tries an unreachable bootstrap 15 times, 1 s apart; 3 keep the fault short.
        prealloc_queue._max_ensure_retries = 3
        return prealloc_queue, transfer_queue

    def _scatter_free_pages(self, rng: np.random.Generator) -> None:
        """A decode server that has served before: its free pages in no particular order."""
        order = torch.from_numpy(rng.permutation(len(self.allocator.free_pages)))
        self.allocator.free_pages = self.allocator.free_pages[order]

    def _changed_pages(self) -> np.ndarray:
        """Per page, whether any pool byte differs from the sentinel."""
        num_pages = self.scenario.decode_pages + 1  # page 0 is the pool's padding page
        changed = torch.zeros(num_pages, dtype=torch.bool)
        for buffer in self._buffers():
            changed |= (_as_bytes(buffer).reshape(num_pages, -1) != SENTINEL_BYTE).any(dim=1)
        return changed.numpy()

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the decode server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=array("q", spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host=LOOPBACK,
            bootstrap_port=spec.bootstrap_port or self.ports.bootstrap, bootstrap_room=spec.room,
        )  # fmt: skip

    def _locs(self, req: Any, n: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]

    def _aux_ok(self, spec: PDRequest, req: Any) -> bool:
        return list(req.output_ids) == [spec.next_token] and (
            self.draft_pool is None or torch.equal(req.hidden_states_tensor, expected_hidden_state(spec))
        )

    def _release(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree_cache, checkpoint=False)

    def _keep(self, spec: PDRequest, locs: torch.Tensor, req: Any) -> None:
        """Decoding ends here: the row goes back; the pages stay held, so the final
        re-check sees whether a later transfer wrote into them (planted requests are
        re-checked apart)."""
        kept = self.served if self.scenario.plant_for(spec.rid) is None else self.planted
        kept.append((spec, locs))
        self.req_to_token_pool.free(req)

    def _mismatches(self, spec: PDRequest, locs: torch.Tensor) -> Tuple[int, int]:
        """(target, draft) tokens whose bytes differ from the pattern at decode's ``locs``."""
        ids, pos = torch.tensor(spec.token_ids), torch.arange(len(spec.token_ids))
        target = count_kv_mismatches(self.kv_pool, locs, ids, pos, pattern=self.pattern)
        if self.draft_pool is None:
            return target, 0
        first = self.pattern.draft_first_layer
        return target, count_kv_mismatches(self.draft_pool, locs, ids, pos, first_layer=first, pattern=self.pattern)

def decode_role(
    channel: RoleChannel, scenario: PDScenario, ports: PDPorts, rids: Optional[Sequence[str]] = None
) -> DecodeReport:
    """Role: the decode server; serves the scenario's requests (or only ``rids``)."""
    load_plugins()  # pip-installed beside SGLang on the decode server too (its flag is off)
    server = DecodeServer(scenario, ports)
    channel.event("ready")
    outcomes = [server.serve(spec) for spec in scenario.requests if rids is None or spec.rid in rids]
    return server.report(outcomes)


#: This line's roles for the line-agnostic cluster runners of ``testing.pd``
#: (``run_pd_cluster``, ``run_fault_cluster``, ``prefill_startup_failure``).
LINE = PDLine(prefill_role=prefill_rank_role, decode_role=decode_role)


__all__ = [
    "LINE",
    "PDScenario",
    "PLANTS",
    "planted_filter",
    "DRAFT_LAYERS",
    "HARNESS_PATTERN",
    "KVPattern",
    "DecodeServer",
    "build_draft_pool",
    "expected_hidden_state",
    "PrefillRank",
    "count_kv_mismatches",
    "decode_role",
    "prefill_rank_role",
    "store_tokens",
    "write_owned_kv",
]
