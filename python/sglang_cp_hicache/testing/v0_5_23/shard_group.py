"""Gloo stand-ins for what SGLang 0.5.23's sharded KV pool takes from NCCL, for CPU ranks.

``PageInterleaveDSATokenToKVPool`` (``mem_cache/page_interleave_pool.py``) is given a shard
group (a ``GroupCoordinator``) and builds a dedicated ``PyNcclCommunicator`` over its
``cpu_group`` for the per-layer prefix all-gather. On CPU there is no NCCL, so:

* :class:`GlooShardGroup` carries the attributes the pool reads from its group
  (``world_size``, ``rank_in_group``, ``cpu_group``, ``device``), built from a
  :class:`~sglang_cp_hicache.testing.dist.RankContext` (the CP group of all ranks);
* :class:`GlooGatherCommunicator` has the communicator surface the pool calls (constructor
  ``(group=, device=, cta_policy=)``, ``disabled``, ``change_state(enable=)``,
  ``all_gather(output, input)``) and gathers over the gloo group
  (``torch.distributed.all_gather_single``, torch 2.14's name for
  ``all_gather_into_tensor``);
* :func:`bind_gather_communicator` / :func:`install_gather_communicator` rebind the name the
  pool constructs its communicator by, ``PyNcclCommunicator`` in
  ``sglang.srt.mem_cache.page_interleave_pool`` (the module imports the class by name, so
  patching ``pynccl`` itself would not reach it).

Only for CPU tests: a real deployment keeps NCCL. Nothing here changes rank-local data
except the gathered output, so the pool's own byte layout is what the tests check.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from sglang_cp_hicache.testing.dist import RankContext

logger = logging.getLogger(__name__)

#: Where the sharded pool looks its communicator class up.
POOL_MODULE = "sglang.srt.mem_cache.page_interleave_pool"


@dataclass(frozen=True)
class GlooShardGroup:
    """The shard group's ``GroupCoordinator`` surface that the sharded pool reads.

    Invariant: ``0 <= rank_in_group < world_size`` and ``ranks`` lists the group's global
    ranks in group order (``ranks[rank_in_group]`` is this process).
    """

    world_size: int
    rank_in_group: int
    cpu_group: Any  # a gloo torch.distributed ProcessGroup
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ranks: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.rank_in_group < self.world_size:
            raise ValueError(
                f"rank_in_group {self.rank_in_group} outside a shard group of "
                f"{self.world_size}"
            )
        if self.ranks and len(self.ranks) != self.world_size:
            raise ValueError(f"ranks {list(self.ranks)} do not match world_size {self.world_size}")

    @property
    def rank(self) -> int:
        """This process's global rank (``GroupCoordinator.rank``)."""
        return self.ranks[self.rank_in_group] if self.ranks else self.rank_in_group

    @classmethod
    def from_rank_context(cls, ctx: RankContext) -> "GlooShardGroup":
        """The attention-CP group of a :func:`~sglang_cp_hicache.testing.dist.run_ranks` rank.

        Under prefill CP the CP group is the shard group (``get_kv_shard_group`` checks CP
        first), so a CP rank's shard rank is its CP rank.
        """
        return cls(
            world_size=dist.get_world_size(ctx.cp_group),
            rank_in_group=dist.get_rank(ctx.cp_group),
            cpu_group=ctx.cp_group,
            ranks=tuple(dist.get_process_group_ranks(ctx.cp_group)),
        )


class GlooGatherCommunicator:
    """``PyNcclCommunicator`` as the sharded pool uses it, over a gloo group.

    Mirrors the real class's enabled state: a one-rank group has nothing to talk to
    (``available`` False, ``disabled`` True); otherwise it starts enabled. A disabled
    communicator's ``all_gather`` is a no-op, as in the real one.
    """

    def __init__(
        self,
        group: Any,
        device: Any,
        library_path: Optional[str] = None,
        is_symmetric_memory_enabled: bool = False,
        cta_policy: Optional[int] = None,
    ) -> None:
        if is_symmetric_memory_enabled or cta_policy is not None:
            # Symmetric windows and CTA policies are NCCL features with no gloo analogue.
            raise ValueError(
                "GlooGatherCommunicator: symmetric memory / cta_policy need NCCL "
                f"(got is_symmetric_memory_enabled={is_symmetric_memory_enabled}, "
                f"cta_policy={cta_policy})"
            )
        self.group = group
        self.device = torch.device(device)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.available = self.world_size > 1
        self.disabled = not self.available

    @contextlib.contextmanager
    def change_state(self, enable: Optional[bool] = None) -> Iterator[None]:
        """Temporarily enable or disable (``None``: back to ``available``)."""
        if enable is None:
            enable = self.available
        previous = self.disabled
        self.disabled = not enable
        try:
            yield
        finally:
            self.disabled = previous

    def all_gather(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        sizes: Optional[List[int]] = None,
    ) -> None:
        """Every rank's ``input_tensor`` into ``output_tensor``, rank-major, in place.

        ``input_tensor`` may be (and, in the pool, is) this rank's block of
        ``output_tensor``; it is cloned before the collective so gloo never reads a
        buffer it is writing.
        """
        if self.disabled:
            return
        if sizes is not None:
            raise NotImplementedError("GlooGatherCommunicator: uneven all_gather (sizes=)")
        for name, tensor in (("output", output_tensor), ("input", input_tensor)):
            if tensor.device != self.device:
                raise ValueError(
                    f"GlooGatherCommunicator on {self.device}: {name} is on {tensor.device}"
                )
            if not tensor.is_contiguous():
                raise ValueError(f"GlooGatherCommunicator: {name} is not contiguous")
        if output_tensor.dtype != input_tensor.dtype:
            raise ValueError(
                f"GlooGatherCommunicator: output {output_tensor.dtype} != "
                f"input {input_tensor.dtype}"
            )
        if output_tensor.numel() != input_tensor.numel() * self.world_size:
            raise ValueError(
                f"GlooGatherCommunicator: output has {output_tensor.numel()} elements, "
                f"expected {self.world_size} x {input_tensor.numel()}"
            )
        # uint8 views: gloo gathers any dtype as bytes (fp8 stores as uint8 already).
        send = input_tensor.reshape(-1).view(torch.uint8).clone()
        recv = output_tensor.reshape(-1).view(torch.uint8)
        dist.all_gather_single(recv, send, group=self.group)


def bind_gather_communicator(pool_module: ModuleType) -> None:
    """Rebind ``pool_module.PyNcclCommunicator`` (``page_interleave_pool``'s module global,
    which ``_init_page_shard_state`` calls) to :class:`GlooGatherCommunicator`."""
    pool_module.PyNcclCommunicator = GlooGatherCommunicator


def install_gather_communicator() -> None:
    """Make sharded pools built from now on use :class:`GlooGatherCommunicator`.

    The CPU runtime (``testing.v0_5_23.runtime.install``) already does this when CUDA is
    unavailable, before the pool module is imported; this is for a process that wants the
    stand-in without the rest. Pools built earlier keep their communicator. Refused where
    CUDA is available: there the real NCCL communicator must run.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "install_gather_communicator: CUDA is available, the sharded pool must use NCCL"
        )
    bind_gather_communicator(importlib.import_module(POOL_MODULE))
    logger.debug("%s.PyNcclCommunicator -> GlooGatherCommunicator", POOL_MODULE)


__all__ = [
    "GlooGatherCommunicator",
    "GlooShardGroup",
    "bind_gather_communicator",
    "install_gather_communicator",
]
