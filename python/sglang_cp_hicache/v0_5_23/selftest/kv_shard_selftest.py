"""Startup self-test of SGLang 0.5.23's sharded DSA read path on this rank's device and CP
group, before the rank serves (extends ``layers/attention/dsa_backend.py``).

Upstream's shard-aware parts of ``DeepseekSparseAttnBackend`` (the gather plan,
``translate_loc_to_scratch``, the scratch page table, the indexer's logical page reads) do
not depend on the sub-backend, but the Hopper kernels the plugin admits (``flashmla_sparse``
over bf16 KV, ``flashmla_kv`` over packed fp8) were never run against the translated tables
upstream. So every sharded target rank, once its pool, shard group and attention backends
exist (AFTER ``ModelRunner.init_attention_backends``, before CUDA graphs and the scheduler
loop), runs one seeded prefill extend twice through upstream's REAL objects with the
RESOLVED backend and kernels:

* *replicated*: an unsharded ``DSATokenToKVPool`` holding every page at its logical loc
  (upstream without sharding);
* *sharded*: a ``PageInterleaveDSATokenToKVPool`` stripe over the server's shard group, each
  rank persisting only its owned pages (the prefix all-gather is the real collective).

Both sides build a ``DeepseekSparseAttnBackend`` over their pool (the server's model runner
with the pool swapped), run ``init_forward_metadata`` (prefill CP split, gather plan,
translation), then per layer the indexer's store and index-K read, its top-k, and
``forward_extend``. Per layer, in order, the stages compare bit for bit:

1. ``gather``: the scratch rows of the cached prefix (latent KV and index-K pages) hold the
   replicated bytes;
2. ``indexer``: the index-K bytes read through the logical page table, and the top-k;
3. ``translation``: every row the attention table (``page_table_1``) addresses holds the
   replicated row's bytes;
4. ``attention``: the kernel's output.

The first mismatch, on any rank, refuses to serve on every rank (the verdicts are exchanged
over the shard group's CPU group at startup, never on the scheduler path): the error names
the stage, the backend and the rank. Kernels come from a :class:`SelfTestKernels` set
chosen by device: on CUDA upstream's own (nothing to install); on CPU the CPU runtime
registers its torch stand-ins (``sglang_cp_hicache.testing.v0_5_23.selftest_kernels``),
product code never imports testing code. Imports no SGLang at module level.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from sglang_cp_hicache.core.field_overlay import FieldOverlay, constant
from sglang_cp_hicache.v0_5_23.selftest.kv_shard_selftest_batch import (
    LayerInputs,
    SelfTestBatch,
    SelfTestBatchSpec,
    SelfTestGeometry,
    SelfTestPools,
    build_selftest_batch,
    dequantize_index_read,
    quantize_index_key,
    seeded_layer_inputs,
)

logger = logging.getLogger(__name__)

SELFTEST_ATTR = "cp_shared_kv_selftest"  # the report, on the model runner
STAGES = ("gather", "indexer", "translation", "attention")


class KvShardSelfTestFailed(RuntimeError):
    """The sharded read path differs from the replicated one: the rank must not serve."""

    def __init__(self, stage: str, backend: str, rank: int, detail: str):
        super().__init__(
            f"--enable-nsa-prefill-cp-shared-kv startup self-test failed at stage '{stage}' "
            f"(backend {backend}, CP rank {rank}): {detail}. Refusing to serve."
        )
        self.stage = stage
        self.backend = backend
        self.rank = rank


# ------------------------------------------------------------------------ kernels
class SelfTestKernels(Protocol):
    """Where upstream's read path finds its kernels on this device while the self-test runs
    (``installed``): nothing to do on CUDA; stand-ins where a kernel needs a GPU."""

    name: str

    def installed(self, cp_group: Any) -> ContextManager[None]: ...


class UpstreamCudaKernels:
    """SGLang 0.5.23's own kernels (Triton index-K reads, FlashMLA, the top-k backend, NCCL
    gathers), exactly as the server resolved them."""

    name = "sglang-cuda"

    def installed(self, cp_group: Any) -> ContextManager[None]:
        return contextlib.nullcontext()


# Kernel sets by device type; the CPU runtime registers "cpu".
SELFTEST_KERNELS: Dict[str, Callable[[], SelfTestKernels]] = {"cuda": UpstreamCudaKernels}


def kernels_for(device: torch.device, backend: str, rank: int) -> SelfTestKernels:
    factory = SELFTEST_KERNELS.get(device.type)
    if factory is None:
        raise KvShardSelfTestFailed(
            "kernels", backend, rank,
            f"no kernel set for device {device.type!r} (CUDA, or the CPU runtime's stand-ins)",
        )
    return factory()


# ------------------------------------------------------------------------ one side
@dataclass
class LayerRecord:
    """What one layer of one side read and produced, as bytes to compare."""

    gather_kv: torch.Tensor  # scratch (or pool) rows of the cached prefix
    gather_index: torch.Tensor  # index-K pages of the cached prefix
    index_read: Tuple[torch.Tensor, torch.Tensor]  # keys, scales the indexer read
    topk: torch.Tensor  # positions (unfused) or the rows they select, as bytes (fused)
    table_rows: torch.Tensor  # the key-buffer rows page_table_1 addresses, flattened
    attention: torch.Tensor


@dataclass
class SideRun:
    records: List[LayerRecord] = field(default_factory=list)
    prefill_impl: str = ""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def _extend_forward_batch(batch: SelfTestBatch, device: torch.device) -> Any:
    """The ``ForwardBatch`` a scheduler builds for this EXTEND (``input_ids`` only set for
    its length: prefill CP's ``can_apply`` counts it)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    extend = list(batch.extend_lens)
    num_tokens = len(batch.out_cache_loc)
    bs = len(batch.seq_lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int64, device=device),
        out_cache_loc=batch.out_cache_loc.to(device),
        seq_lens_sum=sum(batch.seq_lens),
        seq_lens_cpu=torch.tensor(batch.seq_lens, dtype=torch.int64),
        extend_num_tokens=num_tokens,
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32, device=device),
        extend_seq_lens_cpu=extend,
        extend_prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int32, device=device),
        extend_prefix_lens_cpu=list(batch.prefix_lens),
        positions=torch.cat(
            [torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)]
        ).to(device),
    )


@dataclass
class ReadPathSide:
    """One side (a pool) of the comparison: stores the prefix through the pool's own
    writes, then runs the extend through a real backend over it."""

    runner: Any
    pool: Any
    batch: SelfTestBatch
    inputs: List[LayerInputs]
    device: torch.device

    def rows_of(self, locs: torch.Tensor) -> torch.Tensor:
        """Where this side's read buffers hold ``locs`` (scratch rows when sharded)."""
        translate = getattr(self.pool, "translate_loc_to_scratch", None)
        return locs.long() if translate is None else translate(locs).long()

    def store_prefix(self, layers: Sequence[Any]) -> None:
        locs = self.batch.prefix_locs.to(self.device)
        for layer, x in zip(layers, self.inputs):
            self.pool.set_mla_kv_buffer(
                layer, locs, x.prefix_nope.to(self.device), x.prefix_rope.to(self.device)
            )
            index_k, scale = quantize_index_key(x.prefix_index_key)
            self.pool.set_index_k_scale_buffer(
                layer.layer_id, locs, index_k.to(self.device), scale.to(self.device)
            )

    def _backend(self) -> Any:
        from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        bs, width = self.batch.req_to_token.shape
        req_to_token_pool = ReqToTokenPool(
            size=bs, max_context_len=width, device=str(self.device), enable_memory_saver=False
        )
        req_to_token_pool.req_to_token[:bs] = self.batch.req_to_token.to(self.device)
        return DeepseekSparseAttnBackend(
            # The server's runner with the self-test's pools in place of its own: the backend
            # reads everything else (model config, device, dtype, page size) from it.
            FieldOverlay(
                self.runner,
                {"token_to_kv_pool": constant(self.pool), "req_to_token_pool": constant(req_to_token_pool)},
            )
        )

    def run(self, layers: Sequence[Any]) -> SideRun:
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.layers.cp.utils import is_cp_active, prepare_cp_forward

        self.store_prefix(layers)
        backend = self._backend()
        forward_batch = _extend_forward_batch(self.batch, self.device)
        cp_active = is_cp_active(forward_batch)
        if cp_active:
            prepare_cp_forward(forward_batch)
        backend.init_forward_metadata(forward_batch)
        strategy = get_cp_strategy() if cp_active else None

        def local(x: torch.Tensor) -> torch.Tensor:  # this rank's (padded) query rows
            x = x.to(self.device)
            return strategy.shard_hidden_states(x, forward_batch) if strategy else x

        side = SideRun(prefill_impl=str(getattr(backend, "dsa_prefill_impl", "")))
        for layer, x in zip(layers, self.inputs):
            side.records.append(self._layer(backend, forward_batch, layer, x, local))
        end = getattr(self.pool, "end_shard_extend", None)  # upstream ends it on the next
        if end is not None:  # non-extend forward; this pool sees none
            end()
        return side

    def _indexer(self, backend, forward_batch, layer, x, local) -> Tuple[torch.Tensor, Tuple]:
        """What ``Indexer._get_topk_ragged`` reads and selects; the fp8 MQA logits are a
        torch product of the bytes read (the kernel is not shard-aware: equal bytes in,
        equal logits out)."""
        index_k, scale = quantize_index_key(x.chunk_index_key)
        self.pool.set_index_k_scale_buffer(
            layer.layer_id, forward_batch.out_cache_loc, index_k.to(self.device), scale.to(self.device)
        )
        metadata = backend.get_indexer_metadata(layer.layer_id, forward_batch)
        ks, _ = metadata.get_indexer_kvcache_range()
        seq_lens_cpu = metadata.get_indexer_seq_len_cpu()
        keys, scales = self.pool.get_index_k_scale_buffer(
            layer.layer_id,
            metadata.get_indexer_seq_len(),
            metadata.get_logical_page_table(),
            int(seq_lens_cpu.sum()),
            int(seq_lens_cpu.max()),
        )
        queries = local(x.index_query)
        logits = queries[: ks.shape[0]].float() @ dequantize_index_read(keys, scales).T
        topk = torch.full(
            (queries.shape[0], backend.dsa_index_topk), -1, dtype=torch.int32, device=self.device
        )
        topk[: ks.shape[0]] = metadata.topk_transform(logits, backend.dsa_index_topk, ks=ks)
        return topk, (_bytes(keys), _bytes(scales))

    def _layer(self, backend, forward_batch, layer, x: LayerInputs, local) -> LayerRecord:
        topk, index_read = self._indexer(backend, forward_batch, layer, x, local)
        out = backend.forward_extend(
            local(x.q_nope),
            x.chunk_nope.to(self.device),
            x.chunk_nope.to(self.device),
            layer,
            forward_batch,
            q_rope=local(x.q_rope),
            k_rope=x.chunk_rope.to(self.device),
            topk_indices=topk,
        )
        kv = self.pool.get_key_buffer(layer.layer_id)  # the slot this layer read (idempotent)
        ps = self.pool.page_size
        prefix_pages = torch.unique(self.batch.prefix_locs // ps).to(self.device)
        index_pages = self.rows_of(prefix_pages * ps) // ps
        metadata = backend.forward_metadata
        table = metadata.page_table_1
        lens = metadata.cache_seqlens_int32.tolist()
        table_rows = torch.cat([table[j, :n] for j, n in enumerate(lens)]).long()
        fused = bool(getattr(backend, "use_fused_topk", False))
        selected = _bytes(kv[topk.clamp(min=0).long()]) if fused else topk.cpu()
        return LayerRecord(
            gather_kv=_bytes(kv[self.rows_of(self.batch.prefix_locs.to(self.device))]),
            gather_index=_bytes(self.pool.get_index_k_with_scale_buffer(layer.layer_id)[index_pages]),
            index_read=index_read,
            topk=selected,
            table_rows=_bytes(kv[table_rows]),
            attention=_bytes(out),
        )


# ------------------------------------------------------------------------ the test
@dataclass
class KvShardSelfTestReport:
    backend: str  # the resolved DSA prefill backend and KV format, e.g. "flashmla_sparse/bf16"
    kernels: str
    rank: int
    cp_size: int
    stages: List[str] = field(default_factory=list)
    seconds: float = 0.0


def _first_mismatch(sharded: SideRun, replicated: SideRun) -> Optional[Tuple[str, str]]:
    """``(stage, detail)`` of the first differing record, in layer then stage order."""
    for layer, (ours, ref) in enumerate(zip(sharded.records, replicated.records, strict=True)):
        checks = (
            ("gather", "latent KV", ours.gather_kv, ref.gather_kv),
            ("gather", "index-K pages", ours.gather_index, ref.gather_index),
            ("indexer", "index-K keys read", ours.index_read[0], ref.index_read[0]),
            ("indexer", "index-K scales read", ours.index_read[1], ref.index_read[1]),
            ("indexer", "top-k", ours.topk, ref.topk),
            ("translation", "rows page_table_1 addresses", ours.table_rows, ref.table_rows),
            ("attention", "forward_extend output", ours.attention, ref.attention),
        )
        for stage, what, a, b in checks:
            if a.shape != b.shape or not torch.equal(a, b):
                return stage, f"layer {layer}: {what} differ between sharded and replicated KV"
    return None


def _agree(shard_group: Any, rank: int, failure: Optional[Tuple[str, str]]) -> List[Tuple]:
    """Every rank's verdict, exchanged over the shard group's CPU group (startup only)."""
    import torch.distributed as dist

    verdicts: List[Any] = [None] * shard_group.world_size
    dist.all_gather_object(verdicts, (rank, failure), group=shard_group.cpu_group)
    return [v for v in verdicts if v[1] is not None]


def _attention_layers(geometry: SelfTestGeometry, num_heads: int, num_layers: int) -> List[Any]:
    from sglang.srt.layers.radix_attention import RadixAttention

    head_dim = geometry.kv_lora_rank + geometry.qk_rope_head_dim
    return [
        RadixAttention(
            num_heads, head_dim, scaling=head_dim**-0.5, num_kv_heads=1,
            layer_id=layer_id, v_head_dim=geometry.kv_lora_rank,
        )
        for layer_id in range(num_layers)
    ]


def resolved_backend_name(geometry: SelfTestGeometry) -> str:
    from sglang.srt.runtime_context import get_exec

    return f"{get_exec().kernel.dsa_prefill_backend}/{geometry.kv_format}"


def run_selftest(
    runner: Any,
    shard_group: Any,
    geometry: SelfTestGeometry,
    kernels: Optional[SelfTestKernels] = None,
    spec: SelfTestBatchSpec = SelfTestBatchSpec(),
) -> KvShardSelfTestReport:
    """The comparison on this rank; raises :class:`KvShardSelfTestFailed` (on every rank)
    naming the first bad stage. Every rank of ``shard_group`` must call it together."""
    from sglang.srt.runtime_context import get_parallel

    start = time.perf_counter()
    rank, size = shard_group.rank_in_group, shard_group.world_size
    device = torch.device(runner.device) if not isinstance(runner.device, torch.device) else runner.device
    backend_name = resolved_backend_name(geometry)
    kernels = kernels or kernels_for(device, backend_name, rank)
    batch = build_selftest_batch(spec, size, geometry.page_size)
    num_heads = runner.model_config.num_attention_heads // get_parallel().attn_tp_size
    inputs = seeded_layer_inputs(batch, geometry, num_heads, spec.num_layers, spec.seed)
    pools = SelfTestPools(geometry, batch, spec.num_layers, device)
    layers = _attention_layers(geometry, num_heads, spec.num_layers)
    failure: Optional[Tuple[str, str]] = None
    with kernels.installed(shard_group.cpu_group), torch.no_grad():
        replicated = ReadPathSide(runner, pools.replicated(size), batch, inputs, device).run(layers)
        sharded = ReadPathSide(runner, pools.sharded(shard_group), batch, inputs, device).run(layers)
        failure = _first_mismatch(sharded, replicated)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    backend_name = f"{backend_name} ({sharded.prefill_impl}, kernels {kernels.name})"
    failed = _agree(shard_group, rank, failure)
    if failure is not None:
        raise KvShardSelfTestFailed(failure[0], backend_name, rank, failure[1])
    if failed:
        peer, (stage, detail) = failed[0]
        raise KvShardSelfTestFailed(
            stage, backend_name, peer,
            f"{detail} (reported by CP rank {peer}; ranks failing: {[r for r, _ in failed]})",
        )
    return KvShardSelfTestReport(
        backend=backend_name,
        kernels=kernels.name,
        rank=rank,
        cp_size=size,
        stages=list(STAGES),
        seconds=time.perf_counter() - start,
    )


def sharded_pool_of(runner: Any) -> Any:
    """The target rank's page-interleave pool; under the flag there must be one."""
    from sglang.srt.layers.attention.kv_shard_hooks import get_kv_shard_pool

    pool = get_kv_shard_pool(runner.token_to_kv_pool)
    if pool is None:
        raise KvShardSelfTestFailed(
            "pool", "-", -1,
            f"the flag is on but this rank's KV pool ({type(runner.token_to_kv_pool).__name__}) "
            "is not KV-sharded",
        )
    return pool


def run_startup_selftest(runner: Any, pool: Any) -> KvShardSelfTestReport:
    """This target rank's self-test on its pool's geometry, device and shard group."""
    report = run_selftest(runner, pool.shard_group, SelfTestGeometry.of_pool(pool))
    logger.info(
        "CP shared KV startup self-test passed on CP rank %d/%d in %.3f s (%s): %s",
        report.rank, report.cp_size, report.seconds, report.backend, ", ".join(report.stages),
    )
    return report


def init_attention_backends_after(result: Any, runner: Any) -> None:
    """AFTER ``ModelRunner.init_attention_backends``: under the flag, on a target rank, log
    the scratch upstream charged and run the self-test; a failure raises before serving.
    Flag off (or a draft worker, which shares the target's format): nothing runs."""
    from sglang_cp_hicache.v0_5_23.selftest.kv_shard_scratch import log_startup_scratch
    from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode

    if not cp_mode(runner.server_args).shards_kv or runner.is_draft_worker:
        return None
    pool = sharded_pool_of(runner)
    log_startup_scratch(runner, pool)
    setattr(runner, SELFTEST_ATTR, run_startup_selftest(runner, pool))
    return None


__all__ = [
    "KvShardSelfTestFailed",
    "KvShardSelfTestReport",
    "SELFTEST_ATTR",
    "SELFTEST_KERNELS",
    "STAGES",
    "SelfTestKernels",
    "UpstreamCudaKernels",
    "init_attention_backends_after",
    "kernels_for",
    "run_selftest",
    "run_startup_selftest",
    "sharded_pool_of",
]
