"""The 0.5.23 startup self-test and sglang-kernel's HiCache transfers on the GPU check host
(``scripts/gpu/device_check.py --sglang 0.5.23``), for each KV format the Hopper admission
admits, at GLM-5's KV geometry.

The self-test runs through its hook (``kv_shard_selftest.init_attention_backends_after``) on
a sharded target rank's model runner, with the device's own kernel set: on CUDA upstream's
(FlashMLA from sgl-flash-mla, the top-k kernels, Triton stores and reads), on CPU the CPU
runtime's stand-ins. On CUDA each format runs once per top-k path a server can take
(:data:`CUDA_TOPK_PATHS`): the fused transform's JIT kernel (the default) and
sglang-kernel's ``fast_topk_transform_*_fused`` (what prefill CP's indexer calls); both
need GLM-5's ``index_topk`` of 2048.

The CP ranks of the check share the host's one GPU, and NCCL refuses two ranks on one
device; so what the server takes from NCCL runs over the ranks' gloo CP group with host
staging (:class:`HostStagedGather`), the check's own shim: the sharded pool's layer-ahead
prefix all-gather and the attention-CP all-gather, with NCCL's zero-SM symmetric-window
gather off (``SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER``). The product's code paths are not
touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sglang_cp_hicache.testing.reference_sparse_mla import SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_23.shard_group import POOL_MODULE, GlooGatherCommunicator, GlooShardGroup

#: GLM-5's per-rank attention geometry under prefill CP (64 query heads, 512 + 64 latent,
#: a 128-wide indexer selecting 2048 positions), three layers (a stale scratch slot then
#: holds an earlier layer's prefix).
GPU_CHECK_CONFIG = SparseMLAConfig(
    num_layers=3,
    hidden_size=1024,
    num_heads=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=2048,
    page_size=64,
    kv_dtype=torch.bfloat16,
)
#: Top-k paths per device: the DSA top-k backend and the environment that selects the path.
CUDA_TOPK_PATHS: Dict[str, Tuple[str, Dict[str, bool]]] = {
    "jit-v2": ("sgl-kernel", {"SGLANG_DSA_FUSE_TOPK": True, "SGLANG_OPT_USE_TOPK_V2": True}),
    "sgl-kernel": ("sgl-kernel", {"SGLANG_DSA_FUSE_TOPK": True, "SGLANG_OPT_USE_TOPK_V2": False}),
}
#: On CPU the stand-in kernel set runs upstream's torch top-k, unfused.
CPU_TOPK_PATHS: Dict[str, Tuple[str, Dict[str, bool]]] = {"torch": ("torch", {"SGLANG_DSA_FUSE_TOPK": False})}


def topk_paths(device: torch.device) -> Dict[str, Tuple[str, Dict[str, bool]]]:
    return CUDA_TOPK_PATHS if device.type == "cuda" else CPU_TOPK_PATHS


def gpu_kv_formats() -> List[Any]:
    """The admitted formats (``read_path.formats.KV_FORMATS``: names, backends, pool dtypes) at
    :data:`GPU_CHECK_CONFIG`'s geometry."""
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS

    return [dataclasses.replace(f, config=GPU_CHECK_CONFIG) for f in KV_FORMATS]


# ------------------------------------------------------------------------ gathers
class HostStagedGather(GlooGatherCommunicator):
    """:class:`GlooGatherCommunicator` whose transport stages device tensors through host
    memory and gathers with ``torch.distributed.all_gather`` (present in every torch the
    check meets; torch 2.11 has no ``all_gather_single``). In place, rank-major, as NCCL's."""

    def all_gather(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, sizes: Optional[List[int]] = None
    ) -> None:
        if self.disabled:
            return
        if sizes is not None:
            raise NotImplementedError("HostStagedGather: uneven all_gather (sizes=)")
        if output_tensor.numel() != input_tensor.numel() * self.world_size or not output_tensor.is_contiguous():
            raise ValueError(
                f"HostStagedGather: output of {output_tensor.numel()} elements for "
                f"{self.world_size} x {input_tensor.numel()} (contiguous={output_tensor.is_contiguous()})"
            )
        # A host copy on every device: the pool's input is a block of the output.
        send = input_tensor.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True)
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(parts, send, group=self.group)
        output_tensor.reshape(-1).view(torch.uint8).copy_(torch.cat(parts))


@contextlib.contextmanager
def staged_gathers(shard_group: GlooShardGroup) -> Iterator[None]:
    """Sharded pools built inside use :class:`HostStagedGather`, the attention-CP
    all-gather goes through one, and the zero-SM (NCCL window) gather is off."""
    import importlib

    from sglang.srt.environ import envs
    from sglang.srt.layers.cp import interleave

    pool_module = importlib.import_module(POOL_MODULE)
    cp_gather = HostStagedGather(group=shard_group.cpu_group, device=shard_group.device)
    saved = (pool_module.PyNcclCommunicator, interleave.attn_cp_all_gather_into_tensor)
    pool_module.PyNcclCommunicator = HostStagedGather
    interleave.attn_cp_all_gather_into_tensor = cp_gather.all_gather
    try:
        with envs.SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER.override(False):
            yield
    finally:
        pool_module.PyNcclCommunicator, interleave.attn_cp_all_gather_into_tensor = saved


@contextlib.contextmanager
def env_overrides(values: Dict[str, bool]) -> Iterator[None]:
    from sglang.srt.environ import envs

    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(getattr(envs, name).override(value))
        yield


# ------------------------------------------------------------------------ one rank
def sharded_pool(kv_format: Any, shard_group: GlooShardGroup, device: torch.device) -> Any:
    """A target rank's ``PageInterleaveDSATokenToKVPool`` of ``kv_format`` on ``device``, 32
    pages (the pool the hook finds on the runner; the self-test builds its own from its geometry)."""
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    c, size, pages = kv_format.config, shard_group.world_size, 32
    spec = PageShardSpec(
        shard_rank=shard_group.rank_in_group,
        shard_size=size,
        page_size=c.page_size,
        max_prefix_tokens=pages * size * c.page_size,
        chunk_tokens=pages * c.page_size,
    )
    return PageInterleaveDSATokenToKVPool(
        pages * c.page_size,
        shard_spec=spec,
        shard_group=shard_group,
        page_size=c.page_size,
        kv_lora_rank=c.kv_lora_rank,
        dtype=kv_format.pool_dtype,
        qk_rope_head_dim=c.qk_rope_head_dim,
        layer_num=c.num_layers,
        device=str(device),
        index_head_dim=c.index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=kv_format.pool_kv_cache_dim,
    )


def target_runner(pool: Any, model_config: Any, kv_format: Any, device: torch.device) -> Any:
    """A sharded target rank's model runner as the hook and the backend read it: the flag on
    the record, ``pool``, the published model config, no speculative draft."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

    server_args = ServerArgs(model_path="dummy")
    set_cp_shared_kv_enabled(server_args, True)
    return SimpleNamespace(
        server_args=server_args,
        is_draft_worker=False,
        token_to_kv_pool=pool,
        model_config=model_config,
        device=device.type,
        page_size=kv_format.config.page_size,
        kv_cache_dtype=kv_format.pool_dtype,
        hisparse_coordinator=None,
        max_running_requests=4,
        spec_algorithm=SpeculativeAlgorithm.from_string(None),
    )


def _barrier_timed(group: Any, fn: Callable[[], Any]) -> Tuple[Any, float]:
    dist.barrier(group=group)  # every rank starts together: its seconds are its own work
    start = time.perf_counter()
    return fn(), time.perf_counter() - start


def selftest_entry(runner: Any, group: Any) -> dict:
    """The hook's verdict on this rank: its stages and seconds, or the failing stage."""
    from sglang_cp_hicache.v0_5_23.selftest import kv_shard_selftest as selftest

    try:
        _, seconds = _barrier_timed(group, lambda: selftest.init_attention_backends_after(None, runner))
    except selftest.KvShardSelfTestFailed as exc:
        return {"ok": False, "stage": exc.stage, "error": str(exc)}
    except Exception as exc:  # a kernel that would not run is a failure too
        return {"ok": False, "stage": "exception", "error": f"{type(exc).__name__}: {exc}"}
    report = getattr(runner, selftest.SELFTEST_ATTR)
    return {"ok": True, "stages": list(report.stages), "backend": report.backend, "seconds": seconds}


def run_selftests(shard_group: GlooShardGroup) -> List[dict]:
    """Every admitted format x every top-k path of this device, in the same order on every
    rank (the self-test's gathers and verdicts are collectives)."""
    from sglang.srt.runtime_context import get_context

    from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatchSpec
    from sglang_cp_hicache.testing.v0_5_23.read_path.context import publish_runtime_context

    device = shard_group.device
    entries = []
    with staged_gathers(shard_group):
        for kv_format in gpu_kv_formats():
            model_config = publish_runtime_context(kv_format.config, ReadPathBatchSpec(), shard_group, kv_format)
            for path, (backend, env) in topk_paths(device).items():
                get_context().override("gpu_check", dsa_topk_backend=backend, speculative_dsa_topk_backend=backend)
                with env_overrides(env):
                    runner = target_runner(sharded_pool(kv_format, shard_group, device), model_config, kv_format, device)
                    entry = selftest_entry(runner, shard_group.cpu_group)
                entries.append({"format": kv_format.name, "topk": path, "selftest": entry})
    return entries


def shard_group_on(ctx: Any, device: torch.device) -> GlooShardGroup:
    """The CP group of a launched rank as the shard group, its tensors on ``device``."""
    return dataclasses.replace(GlooShardGroup.from_rank_context(ctx), device=device)


# ------------------------------------------------------------------------ kvcacheio
#: What SGLang 0.5.23's DSA host pools move per token and layer: the bf16 latent row (the
#: packed fp8 row is 656 bytes) and, per page, the indexer's keys and scales.
KVCACHEIO_ITEMS = {"latent_bf16": 576 * 2, "latent_fp8": 656, "index_k_page": 64 * 132}


@dataclasses.dataclass(frozen=True)
class KvcacheioCase:
    """One buffer kind moved device -> host for every layer (the all-layer backup) and back
    one layer at a time (the per-layer load), ``rows`` items of ``item_size`` bytes."""

    name: str
    item_size: int
    layout: str  # the host pool's: layer_first or page_first
    layers: int = 3
    device_rows: int = 1024
    rows: int = 384


def kvcacheio_cases() -> List[KvcacheioCase]:
    return [
        KvcacheioCase(f"{kind}/{layout}", size, layout)
        for kind, size in KVCACHEIO_ITEMS.items()
        for layout in ("layer_first", "page_first")
    ]


def kvcacheio_ops(device: torch.device) -> ModuleType:
    """sglang-kernel's ``kvcacheio`` on CUDA; on CPU the torch reference the CPU runtime
    binds into 0.5.23's host pools (same signatures, the CUDA kernel's addressing)."""
    import importlib

    name = "sgl_kernel.kvcacheio" if device.type == "cuda" else "sglang_cp_hicache.testing.kvcacheio"
    return importlib.import_module(name)


def _pointer_table(buffers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)


def kvcacheio_round_trip(case: KvcacheioCase, device: torch.device) -> List[str]:
    """sglang-kernel's MLA transfers called as SGLang 0.5.23's DSA host pools call them
    (``pool_host/dsa.py``, ``pool_host/mla.py``; ``kernel`` io backend, indices on the
    device): the all-layer D2H of scattered device rows, then each layer's H2D into a
    cleared device buffer. Problems, empty when every byte arrived where it belongs."""
    ops = kvcacheio_ops(device)
    gen = torch.Generator().manual_seed(7)
    pin = device.type == "cuda"
    n, size = case.layers, case.item_size
    device_kv = [
        torch.randint(0, 256, (case.device_rows, size), dtype=torch.uint8, generator=gen).to(device) for _ in range(n)
    ]
    device_idx = (torch.randperm(case.device_rows - 1, generator=gen)[: case.rows] + 1).to(device)
    host_idx = torch.randperm(2 * case.rows, generator=gen)[: case.rows].to(device)
    host_shape = (n, 2 * case.rows, size) if case.layout == "layer_first" else (2 * case.rows, n, size)
    host = torch.zeros(host_shape, dtype=torch.uint8, pin_memory=pin)
    src_table = _pointer_table(device_kv, device)
    if case.layout == "layer_first":
        ops.transfer_kv_all_layer_mla(
            src_layers=src_table, dst_layers=_pointer_table(list(host), device), src_indices=device_idx,
            dst_indices=host_idx, item_size=size, num_layers=n,
        )  # fmt: skip
    else:
        ops.transfer_kv_all_layer_mla_lf_pf(
            src_layers=src_table, dst=host, src_indices=device_idx, dst_indices=host_idx, item_size=size,
            dst_layout_dim=n * size, num_layers=n,
        )  # fmt: skip
    loaded = [torch.zeros_like(kv) for kv in device_kv]
    for layer in range(n):
        if case.layout == "layer_first":
            ops.transfer_kv_per_layer_mla(
                src=host[layer], dst=loaded[layer], src_indices=host_idx, dst_indices=device_idx, item_size=size,
            )  # fmt: skip
        else:
            ops.transfer_kv_per_layer_mla_pf_lf(
                src=host, dst=loaded[layer], src_indices=host_idx, dst_indices=device_idx, layer_id=layer,
                item_size=size, src_layout_dim=n * size,
            )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return _round_trip_problems(case, device_kv, host, loaded, device_idx.cpu(), host_idx.cpu())


def _round_trip_problems(
    case: KvcacheioCase, device_kv: Sequence[torch.Tensor], host: torch.Tensor,
    loaded: Sequence[torch.Tensor], device_idx: torch.Tensor, host_idx: torch.Tensor,
) -> List[str]:  # fmt: skip
    """Per layer: the host rows hold the device rows they were given, the reloaded device
    buffer holds them at their device rows and nothing anywhere else."""
    problems = []
    for layer in range(case.layers):
        expected = device_kv[layer].cpu()
        on_host = host[layer] if case.layout == "layer_first" else host[:, layer]
        if not torch.equal(on_host[host_idx], expected[device_idx]):
            problems.append(f"{case.name} layer {layer}: the all-layer backup put other bytes on the host")
        back = loaded[layer].cpu()
        untouched = torch.ones(case.device_rows, dtype=torch.bool)
        untouched[device_idx] = False
        if not torch.equal(back[device_idx], expected[device_idx]):
            problems.append(f"{case.name} layer {layer}: the per-layer load put other bytes on the device")
        if back[untouched].any():
            problems.append(f"{case.name} layer {layer}: the per-layer load wrote rows it was not given")
    return problems


def kvcacheio_check(device: torch.device) -> dict:
    """Every :func:`kvcacheio_cases` round trip; a case that raises is reported, the others
    still run."""
    results = {}
    for case in kvcacheio_cases():
        try:
            results[case.name] = kvcacheio_round_trip(case, device)
        except Exception as exc:
            results[case.name] = [f"{case.name}: {type(exc).__name__}: {exc}"]
    problems = [p for found in results.values() for p in found]
    return {"ok": not problems, "cases": sorted(results), "problems": problems}


__all__ = [
    "CPU_TOPK_PATHS",
    "CUDA_TOPK_PATHS",
    "GPU_CHECK_CONFIG",
    "HostStagedGather",
    "KvcacheioCase",
    "gpu_kv_formats",
    "kvcacheio_check",
    "kvcacheio_ops",
    "kvcacheio_round_trip",
    "run_selftests",
    "shard_group_on",
    "sharded_pool",
    "staged_gathers",
    "target_runner",
    "topk_paths",
]
