"""CPU runtime: lets the real SGLang cache stack (HiRadixCache, cache controllers, host and
NSA device pools) run on a machine without a GPU, for tests and the simulator.

``install()`` must run before ``sglang`` is imported. It

* registers a stand-in ``sgl_kernel`` package whose ``kvcacheio`` holds torch reference
  implementations of the transfer ops, but only when the real ``sgl_kernel`` cannot load;
* points the cache controllers' ``device_module`` at a CPU stream/event module when CUDA is
  unavailable;
* disables CUDA host pinning of host KV pools and the 10 GiB host RAM reserve.

Nothing here is used on a GPU deployment.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE, CpuDeviceModule

logger = logging.getLogger(__name__)

_installed = False
_CONTROLLER_MODULES = (
    "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
)


def _real_sgl_kernel_loads() -> bool:
    if "sgl_kernel" in sys.modules:
        return not getattr(sys.modules["sgl_kernel"], "__cp_hicache_stand_in__", False)
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        importlib.import_module("sgl_kernel.kvcacheio")
        return True
    except Exception:  # a wheel without a driver raises at load time
        sys.modules.pop("sgl_kernel", None)
        sys.modules.pop("sgl_kernel.kvcacheio", None)
        return False


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

    if torch.cuda.is_available():
        return
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


def install() -> None:
    """Install the CPU runtime into this process (idempotent)."""
    global _installed
    if _installed:
        return
    if not _real_sgl_kernel_loads():
        _install_sgl_kernel_stand_in()
    _install_device_module()
    _install_host_memory_patches()
    for name in _CONTROLLER_MODULES:
        importlib.import_module(name)
    _install_device_module()  # rebinds module globals bound before install()
    _installed = True


def device_module() -> CpuDeviceModule:
    """The CPU device module the cache controllers use after :func:`install`."""
    return CPU_DEVICE_MODULE


__all__ = ["install", "device_module", "CpuDeviceModule"]
