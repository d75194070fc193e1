"""What the device and the host lane evictors share: the tier protocol the core planner
is run over, and the planning itself (one rule for both tiers).

A tier (``lane_eviction.DeviceLaneEvictor``, ``host_lane_eviction.HostLaneEvictor``)
answers, from replicated state only: its free pages per owner lane, a node's pages per
lane, its evictable leaves in (priority, node id) order (from the tier's persistent
:class:`~sglang_cp_hicache.core.leaf_heap.LazyLeafHeap`, owned by the cache's extension,
``cache_extension.keys_only_grow``),
and the parent a planned set frees. :func:`plan_tier_victims` hands that to
:func:`sglang_cp_hicache.core.lane_eviction.plan_lane_victims`; each tier evicts the plan
its own way (upstream's device walk, upstream's host walk).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, List, Optional, Protocol, Sequence, Set

from sglang_cp_hicache.core.lane_eviction import plan_lane_victims

Priority = Callable[[Any], Any]


class LaneTier(Protocol):
    """One tier's view for the planner (pages per owner lane; nodes of upstream's tree)."""

    def free_pages(self) -> List[int]: ...

    def lane_pages(self, node: Any) -> List[int]: ...

    def candidates(self, priority: Priority) -> Iterator[Any]: ...

    def freed_parent(self, node: Any, planned: Set[Any]) -> Optional[Any]: ...


@functools.lru_cache(maxsize=None)
def full_type() -> Any:
    """``ComponentType.FULL``, imported on the first call only: the planner reads it per
    node, and an in-function import costs microseconds."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.FULL


def _parent_of(node: Any) -> Any:
    return node.parent


def plan_tier_victims(
    tier: LaneTier, deficit: Sequence[int], priority: Priority
) -> Optional[List[Any]]:
    """Victims of ``tier`` that free ``deficit`` pages per lane (an inner node reached
    through its leaves in the walk's own turn), None when the short lanes cannot be
    covered."""
    return plan_lane_victims(
        tier.candidates(priority), deficit, tier.lane_pages, tier.freed_parent, priority,
        parent_of=_parent_of,
    )  # fmt: skip


__all__ = ["LaneTier", "Priority", "full_type", "plan_tier_victims"]
