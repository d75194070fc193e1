"""Registration of the CPU runtime: each piece only where it is missing, and never a silent
fallback to the stand-in on a machine with CUDA. "CUDA present" and "the real kernel loads"
are simulated through the two probes; no GPU is needed."""

from __future__ import annotations

import sys

import pytest
from sglang.srt.mem_cache import memory_pool_host

from sglang_cp_hicache.testing.v0_5_12 import runtime as testing
from sglang_cp_hicache.testing.v0_5_12.runtime import InstallPlan, RealKernelMissing, plan_install


def _loads() -> None:
    """Probe stand-in: the real ``sgl_kernel.kvcacheio`` imports."""


def _fails() -> None:
    """Probe stand-in: the real ``sgl_kernel.kvcacheio`` does not import."""
    raise ImportError("libcuda.so.1: cannot open shared object file")


def test_cuda_with_a_broken_kernel_raises_the_import_error() -> None:
    with pytest.raises(RealKernelMissing, match="libcuda.so.1") as raised:
        plan_install(cuda_available=lambda: True, import_real_kvcacheio=_fails)
    assert isinstance(raised.value.__cause__, ImportError)


def test_cuda_with_the_real_kernel_installs_nothing() -> None:
    plan = plan_install(cuda_available=lambda: True, import_real_kvcacheio=_loads)
    assert plan == InstallPlan(
        sgl_kernel_stand_in=False, host_memory_patches=False, cpu_device_module=False
    )


def test_cpu_without_the_kernel_installs_the_stand_in_and_its_host_patches() -> None:
    plan = plan_install(cuda_available=lambda: False, import_real_kvcacheio=_fails)
    assert plan == InstallPlan(
        sgl_kernel_stand_in=True, host_memory_patches=True, cpu_device_module=True
    )


def test_host_patches_never_come_without_the_stand_in() -> None:
    plan = plan_install(cuda_available=lambda: False, import_real_kvcacheio=_loads)
    assert not plan.sgl_kernel_stand_in and not plan.host_memory_patches
    assert plan.cpu_device_module


def test_the_stand_in_is_not_mistaken_for_the_real_kernel() -> None:
    # This process runs the stand-in: the real-kernel probe must say it does not load.
    assert sys.modules["sgl_kernel"].__cp_hicache_stand_in__
    with pytest.raises(ImportError, match="stand-in"):
        testing._import_real_kvcacheio()
    with pytest.raises(RealKernelMissing, match="stand-in"):
        plan_install(cuda_available=lambda: True)


def test_this_cpu_process_got_every_piece() -> None:
    assert testing.install() == InstallPlan(
        sgl_kernel_stand_in=True, host_memory_patches=True, cpu_device_module=True
    )


def _host_memory_state() -> tuple:
    host_kv_cache = memory_pool_host.HostKVCache
    return memory_pool_host.HICACHE_HOST_MEMORY_RESERVE_BYTES, host_kv_cache.pin_memory


@pytest.fixture
def pristine_host_memory(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """SGLang's unpatched host-memory settings, restored after the test."""
    monkeypatch.setattr(memory_pool_host, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 10 * 1024**3)
    monkeypatch.setattr(memory_pool_host.HostKVCache, "pin_memory", None, raising=False)
    return _host_memory_state()


def test_apply_leaves_host_memory_alone_with_the_real_kernel(
    pristine_host_memory: tuple,
) -> None:
    testing.apply(
        InstallPlan(sgl_kernel_stand_in=False, host_memory_patches=False, cpu_device_module=True)
    )
    assert _host_memory_state() == pristine_host_memory


def test_apply_patches_host_memory_with_the_stand_in(pristine_host_memory: tuple) -> None:
    testing.apply(
        InstallPlan(sgl_kernel_stand_in=True, host_memory_patches=True, cpu_device_module=True)
    )
    reserve, pin_memory = _host_memory_state()
    assert reserve == 0 and isinstance(pin_memory, property)
