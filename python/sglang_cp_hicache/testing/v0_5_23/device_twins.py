"""The sharded-vs-replicated prefill twins of ``read_path/`` on any device, target and MTP
draft, for the GPU check (``scripts/gpu/device_check.py --sglang 0.5.23``).

:class:`DeviceReadPathRank` is :class:`~sglang_cp_hicache.testing.v0_5_23.read_path.rank.ReadPathRank`
with its pools, backend, batch and forward on ``device``; every record comes back to the
CPU for the comparison (bit for bit, owned rows, block table), so the verdicts are the CPU
twin's. Its :meth:`~DeviceReadPathRank.draft` is the EAGLE MTP draft's extend (one NextN
layer over its own sharded pool, the prefill kernel of the format).

:func:`twin_session` publishes the rank's context with the device's kernels: on CPU the
read path's torch stand-ins (:class:`read_path.kernels.CpuKernelStandIns`); on CUDA upstream's own
(Triton index-K reads and stores, the page-table transform and CP split, FlashMLA from
sgl-flash-mla, the torch top-k backend) with the GPU check's shim for NCCL on one GPU
(``gpu_selftest.staged_gathers``: the pool's prefix all-gather and the attention-CP
all-gather over gloo, host-staged). On CUDA the formats run at GLM-5's geometry
(``gpu_selftest.gpu_kv_formats``), the one FlashMLA's SM90 kernels accept.

:func:`misread_prefix_page` is the twins' planted fault: the sharded side's scratch table
shifted one page in the prefix region while backends build their metadata, so attention
reads another page's rows; the comparison must fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, List, Optional

import torch

from sglang_cp_hicache.testing.v0_5_23.read_path import faults
from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatch, ReadPathBatchSpec
from sglang_cp_hicache.testing.v0_5_23.read_path.context import publish_runtime_context
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS
from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns
from sglang_cp_hicache.testing.v0_5_23.read_path.model import (
    ForwardRecord,
    IndexRead,
    ReadPathModel,
    StandInIndexer,
    extend_forward_batch,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.pools import ReadPathPools, build_backend
from sglang_cp_hicache.testing.v0_5_23.read_path.rank import ReadPathRank


def _to(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)


def batch_on(batch: ReadPathBatch, device: torch.device) -> ReadPathBatch:
    """``batch`` with every tensor on ``device`` (lengths stay Python ints)."""
    return dataclasses.replace(
        batch,
        req_to_token=batch.req_to_token.to(device),
        out_cache_loc=batch.out_cache_loc.to(device),
        prefix_locs=batch.prefix_locs.to(device),
        prefix_kv=[t.to(device) for t in batch.prefix_kv],
        prefix_index_key=[t.to(device) for t in batch.prefix_index_key],
        chunk_hidden=batch.chunk_hidden.to(device),
        chunk_requests=batch.chunk_requests.to(device),
    )


def record_on_cpu(record: ForwardRecord) -> ForwardRecord:
    cpu = torch.device("cpu")
    return ForwardRecord(
        topk=[t.cpu() for t in record.topk],
        index_reads=[IndexRead(r.keys.cpu(), r.scales.cpu()) for r in record.index_reads],
        attention=[t.cpu() for t in record.attention],
        page_table_1=_to(record.page_table_1, cpu),
        real_page_table=_to(record.real_page_table, cpu),
        table_seq_lens=_to(record.table_seq_lens, cpu),
        hidden=_to(record.hidden, cpu),
        query_requests=_to(record.query_requests, cpu),
    )


def forward_batch_on(batch: ReadPathBatch, device: torch.device) -> Any:
    """The scheduler's ``ForwardBatch`` of the EXTEND with its device tensors on ``device``
    (the ``*_cpu`` fields stay on the host, as upstream keeps them)."""
    forward_batch = extend_forward_batch(batch)
    for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens",
                 "extend_prefix_lens", "positions"):  # fmt: skip
        setattr(forward_batch, name, getattr(forward_batch, name).to(device))
    return forward_batch


class DevicePools(ReadPathPools):
    """:class:`ReadPathPools` on a device (frozen dataclass: the device is a field)."""

    def __init__(self, config, spec, shard_group, kv_format, device: torch.device) -> None:
        super().__init__(config, spec, shard_group, kv_format)
        object.__setattr__(self, "device", device)

    def _kwargs(self) -> dict:
        return dict(super()._kwargs(), device=str(self.device))


class DeviceIndexer(StandInIndexer):
    """The stand-in indexer's top-k on the device of the queries."""

    def forward(self, local_hidden, full_key, forward_batch, backend, pool, layer_id):
        topk, read = super().forward(local_hidden, full_key, forward_batch, backend, pool, layer_id)
        return topk.to(local_hidden.device), read


class DeviceReadPathModel(ReadPathModel):
    """:class:`ReadPathModel`'s layer loop with the forward batch on the model's device."""

    def __init__(self, config, weights, layers, device: torch.device) -> None:
        super().__init__(config, weights, layers)
        self.device = device
        self.indexer = DeviceIndexer(config, weights)

    def _forward_batch(self, batch: ReadPathBatch) -> Any:
        return forward_batch_on(batch, self.device)

    def _finished(self, record: ForwardRecord) -> ForwardRecord:
        return record_on_cpu(record)  # compared on the CPU, whatever device ran it


def build_backend_on(pool: Any, batch: ReadPathBatch, model_config: Any, rank: "DeviceReadPathRank") -> Any:
    """``read_path.pools.build_backend`` with the runner and ``req_to_token`` on the rank's device
    (an H200's capability is only faked on CPU; on CUDA the device is one)."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    device, num_reqs = rank.device, len(batch.seq_lens)
    if device.type == "cpu":
        return build_backend(pool, batch, model_config, rank.config, rank.kv_format, rank.draft_worker)
    req_to_token_pool = ReqToTokenPool(
        size=num_reqs, max_context_len=batch.req_to_token.shape[1], device=str(device), enable_memory_saver=False
    )
    req_to_token_pool.req_to_token[:num_reqs] = batch.req_to_token.to(device)
    model_runner = SimpleNamespace(
        device=device.type,
        page_size=rank.config.page_size,
        model_config=model_config,
        token_to_kv_pool=pool,
        req_to_token_pool=req_to_token_pool,
        is_draft_worker=rank.draft_worker,
        hisparse_coordinator=None,
        kv_cache_dtype=rank.kv_format.pool_dtype,
        max_running_requests=num_reqs,
    )
    return DeepseekSparseAttnBackend(model_runner)


@dataclass
class DeviceReadPathRank(ReadPathRank):
    """:class:`ReadPathRank` on ``device``: same batch, weights and verdicts."""

    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        from sglang_cp_hicache.testing.reference_sparse_mla import random_weights

        super().__post_init__()
        c = self.config
        self.pools = DevicePools(c, self.spec, self.shard_group, self.kv_format, self.device)
        weights = random_weights(c, self.spec.seed + 1, self.device)
        self.model = DeviceReadPathModel(c, weights, self.layers, self.device)
        self.device_batch = batch_on(self.batch, self.device)

    def draft(self) -> "DeviceReadPathRank":
        return DeviceReadPathRank(
            self.shard_group, self.model_config, self.spec, dataclasses.replace(self.config, num_layers=1),
            self.kv_format, draft_worker=True, device=self.device,
        )  # fmt: skip

    def _stored_batch(self) -> ReadPathBatch:
        return self.device_batch

    def run(self, pool: Any) -> ForwardRecord:
        self.store_prefix(pool)
        backend = build_backend_on(pool, self.device_batch, self.model_config, self)
        return self.model.forward(backend, pool, self.device_batch)


@contextlib.contextmanager
def twin_session(shard_group: Any, kv_format: Any, device: torch.device) -> Iterator[DeviceReadPathRank]:
    """This rank's published context and kernels for ``kv_format`` on ``device`` (every
    rank of ``shard_group`` enters it and runs the same twins in the same order)."""
    from sglang.srt.environ import envs

    shard_group = dataclasses.replace(shard_group, device=device)
    spec = ReadPathBatchSpec()
    with envs.SGLANG_DEBUG_MEMORY_POOL.override(True), envs.SGLANG_DSA_FUSE_TOPK.override(False):
        with contextlib.ExitStack() as stack:
            if device.type == "cpu":
                stack.enter_context(CpuKernelStandIns(shard_group.cpu_group))
            else:
                from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import staged_gathers

                stack.enter_context(staged_gathers(shard_group))
            model_config = publish_runtime_context(kv_format.config, spec, shard_group, kv_format)
            yield DeviceReadPathRank(
                shard_group, model_config, spec, kv_format.config, kv_format, device=device
            )


def twin_formats(device: torch.device) -> List[Any]:
    """The admitted formats at the device's twin geometry (tiny on CPU, GLM-5's on CUDA)."""
    if device.type == "cpu":
        return list(KV_FORMATS)
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import gpu_kv_formats

    return gpu_kv_formats()


def misread_prefix_page() -> ContextManager[None]:
    """The planted fault: while a backend builds its metadata, the sharded pool's scratch
    translation points prefix rows one page further (the chunk stage and the indexer keep
    the real translation), so attention reads another page's KV."""
    return faults.scratch_table_rewritten(faults.prefix_rows_one_page_on)


__all__ = [
    "DeviceReadPathRank",
    "batch_on",
    "misread_prefix_page",
    "record_on_cpu",
    "twin_formats",
    "twin_session",
]
