"""The CPU runtime's side of the 0.5.23 startup self-test: its kernel set (the read path's
torch stand-ins) and the model runner a CPU rank hands the hook.

:class:`~sglang_cp_hicache.v0_5_23.selftest.kv_shard_selftest.SelfTestKernels` for
``device.type == "cpu"``, registered by the CPU runtime right after the self-test module is
imported (:func:`register_cpu_kernels`). While installed, upstream's read path finds the
stand-ins of :class:`~sglang_cp_hicache.testing.v0_5_23.read_path.kernels.CpuKernelStandIns` (index-K
read, top-k page-table transform, CP query split, FlashMLA sparse, the attention-CP gather
over the gloo group, an H200's capability while a backend is built), and fused top-k is off
(upstream's torch top-k backend has no fused transform, ``dsa_topk_backend.py:269``).
:func:`selftest_runner` is the bundle of model-runner attributes the hook and the backend
read on a sharded target rank (a real ``ModelRunner`` loads a model onto a GPU), over a
:class:`~sglang_cp_hicache.testing.v0_5_23.read_path.rank.ReadPathRank`'s published context.
Imports nothing heavy at module level: the runtime imports it while installing.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator


class CpuStandInKernels:
    """Torch stand-ins for what needs a GPU; everything else is upstream's own code."""

    name = "cpu-torch-stand-ins"

    @contextlib.contextmanager
    def installed(self, cp_group: Any) -> Iterator[None]:
        from sglang.srt.environ import envs

        from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns

        with envs.SGLANG_DSA_FUSE_TOPK.override(False), CpuKernelStandIns(cp_group):
            with CpuKernelStandIns.hopper_capability():
                yield


def selftest_runner(rank: Any) -> Any:
    """A sharded target rank's model runner as the hook reads it: the record with the
    plugin's flag, a fresh ``PageInterleaveDSATokenToKVPool`` of ``rank``'s format on
    its shard group, the published model config, CPU device, no speculative draft."""
    from types import SimpleNamespace

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

    server_args = ServerArgs(model_path="dummy")
    set_cp_shared_kv_enabled(server_args, True)
    return SimpleNamespace(
        server_args=server_args,
        is_draft_worker=False,
        token_to_kv_pool=rank.pools.sharded(),
        model_config=rank.model_config,
        device="cpu",
        page_size=rank.config.page_size,
        kv_cache_dtype=rank.kv_format.pool_dtype,
        hisparse_coordinator=None,
        max_running_requests=len(rank.spec.seq_lens),
        spec_algorithm=SpeculativeAlgorithm.from_string(None),
    )


def register_cpu_kernels(selftest_module: ModuleType) -> None:
    """Post-import callback on ``kv_shard_selftest``: its kernel set for CPU devices."""
    selftest_module.SELFTEST_KERNELS["cpu"] = CpuStandInKernels


__all__ = ["CpuStandInKernels", "register_cpu_kernels", "selftest_runner"]
