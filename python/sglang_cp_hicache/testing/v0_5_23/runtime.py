"""The 0.5.23 line's CPU runtime: lets SGLang 0.5.23's real cache stack (UnifiedRadixCache,
HybridCacheController, host pools, the page-interleave sharded DSA pool and allocator) run
on a machine without a GPU, for tests and the simulator.

``install()`` runs before ``sglang`` is imported and imports no SGLang itself: each piece
is a post-import callback (:mod:`sglang_cp_hicache.core.import_watcher`) on the module it
patches, run right after that module's body executes, or at once when it already has.
It installs only what this process lacks (see :class:`InstallPlan`); where CUDA is
available it installs nothing and the real ``sgl_kernel.kvcacheio`` must import (a failing
import there is an error, never a fallback). On CPU:

* **kvcacheio reference ops**: 0.5.23's host-pool modules bind the transfer ops only
  ``if _is_cuda or _is_hip`` (``mem_cache/pool_host/mla.py:54``, ``pool_host/dsa.py:47``,
  ``memory_pool_host.py:44``, ...), so on CPU the names are undefined and the first D2H
  fails. Each module gets, as globals, exactly the names it imports from
  ``sgl_kernel.kvcacheio`` under CUDA (read from its source), bound to the torch
  reference ops of :mod:`sglang_cp_hicache.testing.kvcacheio`. No ``sgl_kernel`` package
  is registered: 0.5.23 imports it nowhere on a CPU path.
* **host memory**: no ``cudaHostRegister`` (``HostKVCache.pin_memory`` reads False) and no
  10 GiB host RAM reserve (``pool_host/base.py``).
* **device module**: the cache controller's and the L2 transfer engine's ``device_module``
  (``torch.cpu`` on CPU, whose ``Stream`` lacks ``synchronize``) becomes
  :data:`~sglang_cp_hicache.testing.device.CPU_DEVICE_MODULE`, whose events a test can
  hold in flight.
* **gather communicator**: the sharded pool's ``PyNcclCommunicator`` becomes the gloo
  :class:`~sglang_cp_hicache.testing.v0_5_23.shard_group.GlooGatherCommunicator`.
* **JIT HiCache modules**: ``kernels/ops/kvcache/hicache.py``'s wrappers run as shipped over
  the torch stand-ins of their compiled modules (:mod:`sglang_cp_hicache.testing.hicache_jit`:
  ``_jit_hicache_module``, ``_jit_hicache_tma_module``) and answer ``use_hicache_tma_kernel``
  as an sm_90 part would, so ``can_use_hicache_jit_kernel``, the one-layer
  ``transfer_hicache_one_layer_mla`` and the all-layer ``transfer_hicache_all_layer_mla``
  work on CPU. The MLA host pool's ``can_use_jit`` is what that part computes
  (``pool_host/mla.py:264`` gates it on CUDA/ROCm first, so it is re-evaluated after
  ``_initialize_transfer_views`` without the gate): its transfers take the JIT branches a
  GPU takes. The staged write-back kernel (``can_use_write_back_jit``) has no stand-in and
  stays off.
* **Triton stand-ins** (only when Triton has no driver): torch versions of the indexer
  store ``dsa_index_k_cache.SetKAndS.execute`` and the sharded pool's MLA row read
  ``page_interleave_pool.get_mla_kv_buffer_triton``.

It never registers a ``sglang.srt.platforms`` plugin: ``KVCacheConfigurator._resolve_kv_shard``
refuses KV sharding on out-of-tree platforms (``kv_cache_configurator.py:417-433``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Tuple

import torch

from sglang_cp_hicache.core.import_watcher import process_watcher
from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE
from sglang_cp_hicache.testing.reference_sparse_mla import get_mla_kv_buffer_reference

logger = logging.getLogger(__name__)

#: Host-pool modules whose transfer ops are bound only under CUDA/ROCm. HiSparse and the
#: MiniMax/embedding pools are left out: sharding refuses HiSparse, and no reference
#: exists for ``transfer_embedding_ranges_direct``.
HOST_POOL_MODULES: Tuple[str, ...] = (
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.dsa",
    "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.pool_host.unified",
    "sglang.srt.mem_cache.pool_host.mamba",
)
#: Modules holding a module-level ``device_module = get_device_module()``.
DEVICE_MODULE_HOLDERS: Tuple[str, ...] = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.l2_transfer",
)
HOST_POOL_BASE = "sglang.srt.mem_cache.pool_host.base"
PAGE_INTERLEAVE_POOL = "sglang.srt.mem_cache.page_interleave_pool"  # = shard_group.POOL_MODULE
DSA_INDEX_K_CACHE = "sglang.kernels.ops.kvcache.dsa_index_k_cache"
HICACHE_JIT = "sglang.kernels.ops.kvcache.hicache"
MLA_HOST_POOL = "sglang.srt.mem_cache.pool_host.mla"
_KVCACHEIO = "sgl_kernel.kvcacheio"


@dataclass(frozen=True)
class InstallPlan:
    """The pieces :func:`install` puts in place; all False where CUDA is available."""

    kvcacheio_reference_ops: bool
    host_memory_patches: bool
    cpu_device_module: bool
    gloo_gather_communicator: bool
    triton_stand_ins: bool
    hicache_jit_stand_ins: bool

    @property
    def installs_nothing(self) -> bool:
        return not any(vars(self).values())


class RealKernelMissing(RuntimeError):
    """CUDA is available but the real ``sgl_kernel.kvcacheio`` does not import."""


class UpstreamLayoutChanged(RuntimeError):
    """An SGLang module the runtime patches is not where, or not what, 0.5.23 ships."""


# ------------------------------------------------------------------------------------
# Probes
# ------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _import_real_kvcacheio() -> None:
    importlib.import_module(_KVCACHEIO)


def _triton_can_run() -> bool:
    """Whether Triton has an active driver (it has none without a GPU)."""
    try:
        import triton

        triton.runtime.driver.active.get_current_target()
    except Exception:  # ImportError, or "0 active drivers"
        return False
    return True


def plan_install(
    cuda_available: Callable[[], bool] = _cuda_available,
    import_real_kvcacheio: Callable[[], None] = _import_real_kvcacheio,
    triton_can_run: Callable[[], bool] = _triton_can_run,
) -> InstallPlan:
    """Decide what is missing. Raises :class:`RealKernelMissing` (chained to the import
    error) when CUDA is available but the real kernel does not import: the reference ops
    cannot dereference device pointers, and a silent fallback would hide a broken install."""
    if cuda_available():
        try:
            import_real_kvcacheio()
        except Exception as error:
            raise RealKernelMissing(
                f"CUDA is available but {_KVCACHEIO} failed to import: {error!r}"
            ) from error
        return InstallPlan(False, False, False, False, False, False)
    return InstallPlan(
        kvcacheio_reference_ops=True,
        host_memory_patches=True,
        cpu_device_module=True,
        gloo_gather_communicator=True,
        triton_stand_ins=not triton_can_run(),
        hicache_jit_stand_ins=True,
    )


# ------------------------------------------------------------------------------------
# kvcacheio reference ops
# ------------------------------------------------------------------------------------


def _module_source(name: str) -> Path:
    """The source file of ``sglang`` submodule ``name``, found without importing it."""
    spec = importlib.util.find_spec("sglang")  # a top-level find imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise UpstreamLayoutChanged("sglang is not installed as a package")
    relative = Path(*name.split(".")[1:]).with_suffix(".py")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise UpstreamLayoutChanged(f"{name}: no source at {path}")
    return path


def cuda_kvcacheio_names(module_name: str) -> Tuple[str, ...]:
    """The names ``module_name`` imports from ``sgl_kernel.kvcacheio`` at module level
    under a condition (``if _is_cuda or _is_hip:``), read from its source."""
    tree = ast.parse(_module_source(module_name).read_text(), filename=module_name)
    names = []
    for statement in tree.body:
        if not isinstance(statement, ast.If):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.ImportFrom) and node.module == _KVCACHEIO:
                names.extend(alias.asname or alias.name for alias in node.names)
    if not names:
        raise UpstreamLayoutChanged(
            f"{module_name} no longer imports {_KVCACHEIO} under a CUDA condition"
        )
    return tuple(dict.fromkeys(names))


def reference_op_table() -> Dict[str, Dict[str, Callable]]:
    """For each host-pool module, the reference op bound to each name it needs.

    Raises :class:`UpstreamLayoutChanged` naming every op the reference lacks.
    """
    from sglang_cp_hicache.testing import kvcacheio

    table: Dict[str, Dict[str, Callable]] = {}
    missing = []
    for module_name in HOST_POOL_MODULES:
        names = cuda_kvcacheio_names(module_name)
        missing += [f"{module_name}.{n}" for n in names if not hasattr(kvcacheio, n)]
        table[module_name] = {n: getattr(kvcacheio, n, None) for n in names}
    if missing:
        raise UpstreamLayoutChanged(
            "sglang_cp_hicache.testing.kvcacheio lacks ops the host pools need: "
            + ", ".join(missing)
        )
    return table


def _bind_globals(values: Dict[str, object]) -> Callable[[ModuleType], None]:
    def bind(module: ModuleType) -> None:
        for name, value in values.items():
            setattr(module, name, value)

    return bind


# ------------------------------------------------------------------------------------
# Host memory and device module
# ------------------------------------------------------------------------------------


def _patch_host_memory(base: ModuleType) -> None:
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0

    def _record_pin_request(self, value: bool) -> None:
        self._cp_hicache_pin_requested = value

    # No CUDA driver to register host memory with: every host pool stays pageable. A
    # class property, so pools that assign ``self.pin_memory`` go through it too.
    base.HostKVCache.pin_memory = property(lambda self: False, _record_pin_request)


def _bind_device_module(module: ModuleType) -> None:
    module.device_module = CPU_DEVICE_MODULE


# ------------------------------------------------------------------------------------
# Triton stand-ins (torch references of two kernels; same checks, same bytes)
# ------------------------------------------------------------------------------------

_INDEX_HEAD_DIM = 128  # the kernel's fixed FP8 key width
_SCALE_BYTES = 4  # one fp32 scale per token


def set_k_and_s_reference(
    cls,
    pool,
    buf: torch.Tensor,
    loc: torch.Tensor,
    index_k: torch.Tensor,
    index_k_scale: torch.Tensor,
) -> None:
    """Torch ``SetKAndS.execute``: token ``loc`` of page ``loc // ps`` gets its 128 FP8 key
    bytes at ``(loc % ps) * 128`` and its fp32 scale at ``ps * 128 + (loc % ps) * 4``."""
    page_size = pool.index_page_size
    loc = loc.to(torch.int64)
    scale = index_k_scale.reshape(-1) if index_k_scale.ndim == 2 else index_k_scale
    if index_k_scale.ndim == 2 and index_k_scale.shape[1] != 1:
        raise ValueError(f"SetKAndS: index_k_scale shape {tuple(index_k_scale.shape)}")
    checks = {
        "page size 64": page_size == 64,
        "buf uint8 pages of ps*(128+4)": buf.dtype == torch.uint8
        and buf.ndim == 2
        and buf.shape[1] == page_size * (_INDEX_HEAD_DIM + _SCALE_BYTES),
        "index_k (n, 128) float8_e4m3fn": index_k.dtype == torch.float8_e4m3fn
        and index_k.ndim == 2
        and index_k.shape[1] == _INDEX_HEAD_DIM,
        "scale float32": scale.dtype == torch.float32,
        "one key and scale per loc": loc.ndim == 1
        and index_k.shape[0] == loc.shape[0] == scale.shape[0],
        "contiguous": buf.is_contiguous() and index_k.is_contiguous() and scale.is_contiguous(),
    }
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ValueError(f"SetKAndS (CPU reference): {', '.join(failed)}")
    if loc.numel() == 0:
        return
    page, offset = loc // page_size, loc % page_size
    key_cols = offset[:, None] * _INDEX_HEAD_DIM + torch.arange(_INDEX_HEAD_DIM)
    scale_cols = (
        page_size * _INDEX_HEAD_DIM + offset[:, None] * _SCALE_BYTES + torch.arange(_SCALE_BYTES)
    )
    buf[page[:, None], key_cols] = index_k.view(torch.uint8)
    buf[page[:, None], scale_cols] = scale.view(torch.uint8).view(-1, _SCALE_BYTES)


def _bind_set_k_and_s(module: ModuleType) -> None:
    module.SetKAndS.execute = classmethod(set_k_and_s_reference)


def _bind_get_mla_kv_buffer(module: ModuleType) -> None:
    module.get_mla_kv_buffer_triton = get_mla_kv_buffer_reference


def _model_mla_can_use_jit(module: ModuleType) -> None:
    """``MLATokenToKVPoolHost.can_use_jit`` as the modelled CUDA part computes it: the same
    ``can_use_hicache_jit_kernel`` call, without the ``_is_cuda or _is_hip`` gate."""
    cls = module.MLATokenToKVPoolHost
    initialize = cls._initialize_transfer_views

    def _initialize_transfer_views(self) -> None:
        initialize(self)
        self.can_use_jit = module.can_use_hicache_jit_kernel(
            page_size=self.page_size, element_size=self.kv_cache_dim * self.dtype.itemsize
        )

    cls._initialize_transfer_views = _initialize_transfer_views


def _bind_hicache_jit(module: ModuleType) -> None:
    from sglang_cp_hicache.testing import hicache_jit

    for name in ("_jit_hicache_module", "_jit_hicache_tma_module", "use_hicache_tma_kernel"):
        if not callable(getattr(module, name, None)):
            raise UpstreamLayoutChanged(f"{module.__name__}.{name} is gone")
    module._jit_hicache_module = hicache_jit.register_module
    module._jit_hicache_tma_module = hicache_jit.tma_module
    module.use_hicache_tma_kernel = hicache_jit.tma_selector(module.envs.SGLANG_HICACHE_TMA_TRANSFER.get)


# ------------------------------------------------------------------------------------
# Install
# ------------------------------------------------------------------------------------


def patches(plan: InstallPlan) -> Dict[str, Tuple[Callable[[ModuleType], None], ...]]:
    """Module name -> the callbacks ``plan`` runs on it once it is imported."""
    wanted: Dict[str, list] = {}

    def add(name: str, callback: Callable[[ModuleType], None]) -> None:
        wanted.setdefault(name, []).append(callback)

    if plan.kvcacheio_reference_ops:
        for module_name, ops in reference_op_table().items():
            add(module_name, _bind_globals(ops))
    if plan.host_memory_patches:
        add(HOST_POOL_BASE, _patch_host_memory)
    if plan.cpu_device_module:
        for module_name in DEVICE_MODULE_HOLDERS:
            add(module_name, _bind_device_module)
    if plan.gloo_gather_communicator:
        from sglang_cp_hicache.testing.v0_5_23.shard_group import bind_gather_communicator

        add(PAGE_INTERLEAVE_POOL, bind_gather_communicator)
    if plan.hicache_jit_stand_ins:
        add(HICACHE_JIT, _bind_hicache_jit)
        add(MLA_HOST_POOL, _model_mla_can_use_jit)
    if plan.triton_stand_ins:
        add(DSA_INDEX_K_CACHE, _bind_set_k_and_s)
        add(PAGE_INTERLEAVE_POOL, _bind_get_mla_kv_buffer)
    if plan.cpu_device_module:  # the startup self-test's kernel set for CPU devices
        from sglang_cp_hicache.testing.v0_5_23.selftest_kernels import register_cpu_kernels

        add("sglang_cp_hicache.v0_5_23.selftest.kv_shard_selftest", register_cpu_kernels)
    return {name: tuple(callbacks) for name, callbacks in wanted.items()}


_failures: List[str] = []  # patches that raised, "<module>: <error>"
_patched_modules: Tuple[str, ...] = ()


def _strict(callback: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    """The watcher logs and swallows a failing callback; record the failure too, so
    :func:`warm_import` raises it rather than a test meeting a half-patched module."""

    def run(module: ModuleType) -> None:
        try:
            callback(module)
        except Exception as error:
            _failures.append(f"{module.__name__}: {error!r}")
            raise

    return run


def apply(plan: InstallPlan) -> None:
    """Register ``plan``'s patches; each runs now if its module is already imported."""
    global _patched_modules
    watcher = process_watcher()
    table = patches(plan)
    for module_name, callbacks in table.items():
        for callback in callbacks:
            watcher.when_imported(module_name, _strict(callback))
    _patched_modules = tuple(sorted(set(_patched_modules) | set(table)))


@functools.cache
def install() -> InstallPlan:
    """Install what this process is missing of the CPU runtime, once; return the plan."""
    plan = plan_install()
    apply(plan)
    logger.debug("0.5.23 CPU runtime: %s", plan)
    return plan


#: The 0.5.23 cache stack, imported by :func:`warm_import` so set-up fails early.
WARM_MODULES: Tuple[str, ...] = (
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "sglang.srt.mem_cache.page_interleave_pool",
    "sglang.srt.mem_cache.pool_host.page_interleave",
    "sglang.srt.mem_cache.allocator.page_interleave",
    "sglang.srt.mem_cache.pool_host.dsa",
)


def warm_import() -> None:
    """Import the cache stack and every module a patch targets (after :func:`install`), so
    set-up fails here, not in a test. Raises naming every patch that failed."""
    for name in WARM_MODULES + _patched_modules:
        importlib.import_module(name)
    if _failures:
        raise RuntimeError("0.5.23 CPU runtime: patches failed: " + "; ".join(_failures))


__all__ = [
    "InstallPlan",
    "RealKernelMissing",
    "UpstreamLayoutChanged",
    "apply",
    "cuda_kvcacheio_names",
    "install",
    "patches",
    "plan_install",
    "reference_op_table",
    "set_k_and_s_reference",
    "warm_import",
]
