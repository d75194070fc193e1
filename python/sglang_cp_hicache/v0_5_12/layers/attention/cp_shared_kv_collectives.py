"""Materialisation strategy choice and its dedicated process group.

* ``--nsa-prefill-cp-shared-kv-materialize {auto,all_gather,all_reduce}``
  (:func:`add_materialize_cli_arg`, :func:`materialize_choice`): ``auto`` picks by bytes
  moved per rank (:func:`bytes_per_rank`): ``all_gather`` on NCCL (about half of a ring
  all-reduce of the dense buffer); on gloo ``all_reduce``, which measured faster per byte
  there (``docs/attention_runtime.md``). ``SGLANG_CP_SHARED_KV_MATERIALIZE_STRATEGY``, if
  set, overrides ``auto`` (benchmarks); an explicit flag value wins over it.
* :func:`create_materialize_group`: a process group with exactly the ranks of this rank's
  attention CP group, created at init on every rank, so materialisation collectives (and
  the next-layer prefetch) run on their own communicator instead of queueing behind
  SGLang's CP all-gathers on the shared one.
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional, Sequence

from sglang_cp_hicache.v0_5_12.server_args import MATERIALIZE_CHOICES, MATERIALIZE_DEST, MATERIALIZE_FLAG

import torch.distributed as dist

logger = logging.getLogger(__name__)

STRATEGY_ENV = "SGLANG_CP_SHARED_KV_MATERIALIZE_STRATEGY"

_materialize_group: Optional[Any] = None


def materialize_choice(server_args: Any) -> str:
    """The flag's value on ``server_args`` (``auto`` when absent)."""
    choice = getattr(server_args, MATERIALIZE_DEST, None) or "auto"
    if choice not in MATERIALIZE_CHOICES:
        raise ValueError(f"{MATERIALIZE_FLAG} {choice!r}: choose from {', '.join(MATERIALIZE_CHOICES)}")
    return choice


def resolve_strategy(choice: str, backend: str) -> str:
    """Concrete strategy for a flag value on a collective backend (``nccl`` / ``gloo``)."""
    if choice != "auto":
        return choice
    env = os.environ.get(STRATEGY_ENV)
    if env:
        if env not in MATERIALIZE_CHOICES[1:]:
            raise ValueError(f"{STRATEGY_ENV}={env!r}: choose from all_gather, all_reduce")
        return env
    return "all_gather" if backend == "nccl" else "all_reduce"


def bytes_per_rank(strategy: str, prefix_bytes: int, cp_size: int) -> int:
    """Bytes one rank sends per layer to materialise ``prefix_bytes`` of prefix pages.

    Ring all-reduce of the dense buffer: ``2 (cp-1)/cp * prefix``; owner-packed
    all-gather: ``(cp-1)/cp * prefix`` (balanced owners); each rank receives the same.
    """
    if cp_size < 2:
        return 0
    if strategy == "all_reduce":
        return 2 * (cp_size - 1) * prefix_bytes // cp_size
    if strategy == "all_gather":
        return (cp_size - 1) * prefix_bytes // cp_size
    raise ValueError(f"unknown strategy {strategy!r}")


def _all_cp_groups(my_cp_ranks: Sequence[int]) -> List[List[int]]:
    """Every rank's CP group (sorted, distinct, in a fixed order); a world collective."""
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(int(r) for r in my_cp_ranks))
    return sorted({tuple(g) for g in gathered}, key=lambda g: (g[0], len(g)))


def create_materialize_group(my_cp_ranks: Sequence[int], backend: Optional[str] = None) -> Any:
    """A new process group over ``my_cp_ranks``; every rank of the world must call it.

    ``new_group`` is collective over the world, so every CP group is created on every rank
    in the same order; this rank keeps its own.
    """
    global _materialize_group
    backend = backend or dist.get_backend()
    mine = None
    for ranks in _all_cp_groups(my_cp_ranks):
        group = dist.new_group(ranks=list(ranks), backend=backend)
        if dist.get_rank() in ranks:
            mine = group
    _materialize_group = mine
    logger.info("CP shared KV: dedicated %s materialisation group over ranks %s", backend, sorted(my_cp_ranks))
    return mine


def materialize_group() -> Any:
    """The group made by :func:`create_materialize_group`; fail fast if it was not made."""
    if _materialize_group is None:
        raise RuntimeError(
            "CP shared KV: the materialisation process group was not created at init "
            "(ModelRunnerKVCacheMixin.init_memory_pool hook); refusing to share SGLang's "
            "CP communicator silently"
        )
    return _materialize_group
