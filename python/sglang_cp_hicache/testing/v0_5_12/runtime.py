"""The 0.5.12.post1 line's CPU runtime: lets the real SGLang 0.5.12.post1 cache stack
(HiRadixCache, cache controllers, host and NSA device pools) run on a machine without a GPU,
for tests and the simulator.

``install()`` must run before ``sglang`` is imported. It installs only what is missing
(see :class:`InstallPlan`):

* a stand-in ``sgl_kernel`` package whose ``kvcacheio`` holds torch reference
  implementations of the transfer ops, only when CUDA is unavailable and the real
  ``sgl_kernel`` cannot load (with CUDA, a failing import is an error, never a fallback);
* together with the stand-in only: no CUDA host pinning of host KV pools and no 10 GiB host
  RAM reserve (real kernels keep the pinned memory they need);
* a CPU stream/event module for the cache controllers' ``device_module`` when CUDA is
  unavailable.

Nothing here is used on a GPU deployment.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
from dataclasses import dataclass
from typing import Callable

from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE

logger = logging.getLogger(__name__)

_CONTROLLER_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
)


@dataclass(frozen=True)
class InstallPlan:
    """The pieces :func:`install` puts in place. Host patches come only with the stand-in."""

    sgl_kernel_stand_in: bool
    host_memory_patches: bool
    cpu_device_module: bool


class RealKernelMissing(RuntimeError):
    """CUDA is available but the real ``sgl_kernel.kvcacheio`` does not import."""


def _cuda_available() -> bool:
    """Probe: whether this process can use CUDA."""
    import torch

    return torch.cuda.is_available()


def _import_real_kvcacheio() -> None:
    """Probe: import the real ``sgl_kernel.kvcacheio``; raise whatever its import raises."""
    loaded = sys.modules.get("sgl_kernel")
    if getattr(loaded, "__cp_hicache_stand_in__", False):
        raise ImportError("sgl_kernel is the CPU stand-in, not the real package")
    try:
        importlib.import_module("sgl_kernel.kvcacheio")
    except Exception:
        # A wheel without a driver raises at load time; drop the half-imported package.
        for name in ("sgl_kernel", "sgl_kernel.kvcacheio"):
            sys.modules.pop(name, None)
        raise


def plan_install(
    cuda_available: Callable[[], bool] = _cuda_available,
    import_real_kvcacheio: Callable[[], None] = _import_real_kvcacheio,
) -> InstallPlan:
    """Decide what is missing. Raises :class:`RealKernelMissing` (chained to the import
    error) when CUDA is available but the real kernel does not import: a stand-in cannot
    dereference device pointers, and a silent fallback would hide a broken install."""
    cuda = cuda_available()
    try:
        import_real_kvcacheio()
        stand_in = False
    except Exception as error:
        if cuda:
            raise RealKernelMissing(
                f"CUDA is available but sgl_kernel.kvcacheio failed to import: {error!r}"
            ) from error
        stand_in = True
    return InstallPlan(
        sgl_kernel_stand_in=stand_in, host_memory_patches=stand_in, cpu_device_module=not cuda
    )


def _install_sgl_kernel_stand_in() -> None:
    from sglang_cp_hicache.testing import kvcacheio

    # Strict package: no catch-all __getattr__, so SGLang's guarded
    # ``try: from sgl_kernel import X`` keeps its own fallback.
    package = types.ModuleType("sgl_kernel")
    package.__path__ = []
    package.__cp_hicache_stand_in__ = True
    package.kvcacheio = kvcacheio
    sys.modules["sgl_kernel"] = package
    sys.modules["sgl_kernel.kvcacheio"] = kvcacheio


def _install_device_module() -> None:
    import torch

    original = torch.get_device_module
    if not getattr(original, "__cp_hicache_cpu__", False):

        def get_device_module(device=None):
            if device is None:
                return CPU_DEVICE_MODULE
            return original(device)

        get_device_module.__cp_hicache_cpu__ = True
        torch.get_device_module = get_device_module
    for name in _CONTROLLER_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.device_module = CPU_DEVICE_MODULE


def _install_host_memory_patches() -> None:
    from sglang.srt.mem_cache import memory_pool_host

    memory_pool_host.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0

    def _record_pin_request(self, value: bool) -> None:
        self._cp_hicache_pin_requested = value

    # No CUDA driver to register host memory with; the pools stay pageable.
    memory_pool_host.HostKVCache.pin_memory = property(lambda self: False, _record_pin_request)


def apply(plan: InstallPlan) -> None:
    """Put the pieces of ``plan`` in place (each is idempotent)."""
    if plan.sgl_kernel_stand_in:
        _install_sgl_kernel_stand_in()
    if plan.cpu_device_module:
        _install_device_module()
    if plan.host_memory_patches:
        _install_host_memory_patches()
    for name in _CONTROLLER_MODULES:
        importlib.import_module(name)
    if plan.cpu_device_module:
        _install_device_module()  # rebinds module globals bound before install()
        # The startup self-test's readers on CPU: the torch reference of the NSA stages.
        importlib.import_module("sglang_cp_hicache.testing.v0_5_12.selftest_kernels")


@functools.cache
def install() -> InstallPlan:
    """Install what this process is missing of the CPU runtime, once; return the plan."""
    plan = plan_install()
    apply(plan)
    return plan


def warm_import() -> None:
    """Import the cache stack once (after :func:`install`): set-up fails here, not in a test."""
    importlib.import_module("sglang.srt.mem_cache.hiradix_cache")


__all__ = [
    "InstallPlan",
    "RealKernelMissing",
    "apply",
    "install",
    "plan_install",
    "warm_import",
]
