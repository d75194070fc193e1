"""Where a lane-aware device decision is applied: inside upstream's own functions, run over a
view of the cache that carries it (``core.field_overlay.FieldOverlay``: every other attribute
is the cache's, read live; writes raise), or riding in upstream's own parameter object.

The decision is made before (the extend's room and bases, the plan's victims) or by the
call's own step (the load-back's draws, known once upstream's tree core built its transfer)
and handed over with the call; nothing is left on the cache's extension between hooks.

* :class:`ExtendRoom`: upstream's extend allocation once the room for its exact draws is
  made: its own eviction skipped, and the rotation bases the room was made for (read by the
  ``_kv_shard_rotation_bases`` hook off its ``tree_cache`` argument).
* :func:`load_back_view`: upstream's ``_load_back_transfers`` whose tree core records the
  load's draws per owner lane (:class:`LoadDemand`), whose gate answers for them and whose
  ``evict_for_alloc`` asks for them (:class:`LaneDemandParams`).
* :func:`planned_walk`: upstream's device walk (``UnifiedRadixCache._evict``) whose FULL node
  source is a plan's victims.

Imports SGLang's ``base_prefix_cache`` (light, loaded with every cache) for its parameter
object.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_cp_hicache.core.field_overlay import FieldOverlay, constant
from sglang_cp_hicache.core.rotation import lane_of, run_lane_counts
from sglang_cp_hicache.v0_5_23.eviction.lane_tier import full_type


@dataclass
class LaneDemandParams(EvictParams):
    """``EvictParams`` of an eviction whose pages per owner lane are known (an extend's or a
    load-back's exact draws, ``path``): the lane-aware ``evict_for_alloc`` makes room for
    exactly them. Through upstream's own entry, so every lane-aware device eviction is
    where upstream's would be (its callers, its timing in the simulator)."""

    lane_demand: Tuple[int, ...] = ()
    path: str = "load_back"


def _no_eviction(_method: Callable) -> Callable[[], bool]:
    return lambda: False


class ExtendRoom(FieldOverlay):
    """A cache as upstream's extend allocation sees it once the lane-aware room for the
    batch's exact draws is made: its conservative eviction (``evict_from_tree_cache``, whose
    one gate is ``supports_prefix_sharing``, the only use that function makes of it) has
    nothing to do, and ``bases`` are the chains' rotation bases the room was made for
    (frozen; None: the ones upstream reads, every chain continuing where it is)."""

    __slots__ = ("bases",)

    def __init__(self, cache: Any, bases: Optional[Sequence[Optional[int]]]) -> None:
        super().__init__(cache, {"supports_prefix_sharing": _no_eviction})
        object.__setattr__(self, "bases", None if bases is None else tuple(bases))


class LoadDemand:
    """The pages one load-back draws per owner lane: recorded once, when upstream's tree core
    builds its KV transfer (``pages`` None before, or for an empty one). Host slots are
    owner-matched and the load allocates ``alloc_cyclic`` from its first host page's owner,
    so the host indices give the draws exactly (a cyclic run: the tree core loads one
    chain's consecutive pages)."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator  # PageInterleavePoolAllocator
        self.pages: Optional[Tuple[int, ...]] = None

    def record(self, host_indices: Any) -> None:
        if self.pages is not None:
            raise RuntimeError("cp_hicache: a load-back built its KV transfer twice")
        if len(host_indices):
            page_size, lanes = self.allocator.page_size, self.allocator.shard_size
            first_page, pages = int(host_indices[0]) // page_size, len(host_indices) // page_size
            self.pages = tuple(run_lane_counts(lane_of(first_page, lanes), pages, lanes))

    def fits(self) -> bool:
        free = self.allocator.class_free_page_counts()
        return all(need <= have for need, have in zip(self.pages, free))

    def available_size(self, available: int, component_type: Any) -> int:
        """Upstream's gate answered for the load's own draws: FULL capacity is the load's
        tokens when every lane holds its pages (the min-class floor can be up to one page
        per lane short of what the load needs when it is not); else upstream's answer."""
        if self.pages is None or component_type != full_type() or not self.fits():
            return available
        return max(available, sum(self.pages) * self.allocator.page_size)

    def params(self, params: EvictParams) -> EvictParams:
        """Upstream's eviction request, with the draws once they are known."""
        if self.pages is None:
            return params
        return LaneDemandParams(num_tokens=params.num_tokens, lane_demand=self.pages)


def load_back_view(cache: Any, demand: LoadDemand) -> FieldOverlay:
    """``cache`` as upstream's ``_load_back_transfers`` sees it under lane-aware eviction:
    its tree core records the load's draws in ``demand``; its gate
    (``_component_available_size``) and ``evict_for_alloc`` (the cache's own, hooks and all)
    answer and ask for them."""

    def recording_spec(build: Callable) -> Callable:
        def build_load_back_spec(*args: Any, **kwargs: Any) -> Any:
            spec = build(*args, **kwargs)
            demand.record(spec[0].host_indices)
            return spec

        return build_load_back_spec

    tree_core = FieldOverlay(cache.tree_core, {"build_load_back_spec": recording_spec})
    return FieldOverlay(
        cache,
        {
            "tree_core": constant(tree_core),
            "_component_available_size": lambda size: (
                lambda component_type: demand.available_size(size(component_type), component_type)
            ),
            "evict_for_alloc": lambda evict: (
                lambda params, **kwargs: evict(demand.params(params), **kwargs)
            ),
        },
    )


def planned_walk(cache: Any, victims: Iterable[Any]) -> FieldOverlay:
    """``cache`` as upstream's device walk (``UnifiedRadixCache._evict``, run with it as
    ``self``) sees it for one plan: the FULL walk's next node is the next of ``victims``
    still a device leaf (upstream's walk skips a popped node that is not one, e.g. a parent
    whose write-back child stayed), and its start and end build and clear no heap of every
    evictable leaf. Every other step (each leaf demoted or dropped, write-back backups,
    writing check, metrics) is upstream's."""
    full, tree_core, plan = full_type(), cache.tree_core, iter(victims)

    def planned_next(next_node: Callable) -> Callable:
        def evict_device_next_node(component_type: Any, tracker: Any) -> Tuple[Any, bool]:
            if component_type != full:
                return next_node(component_type, tracker)
            leaves = tree_core.evictable_device_leaves
            for node in plan:
                if node in leaves:
                    return node.id, True
            return None, False

        return evict_device_next_node

    def without_full_heap(step: Callable) -> Callable:
        return lambda component_type, *args: None if component_type == full else step(component_type, *args)

    walk_core = FieldOverlay(
        tree_core, {"evict_device_start": without_full_heap, "evict_device_end": without_full_heap}
    )
    walk = FieldOverlay(
        cache,
        {
            "tree_core": constant(walk_core),
            "_evict_device_next_node": planned_next,
            # Upstream's own walk loop, run over this view (its node source is the plan's).
            "_evict_components": lambda _own: functools.partial(type(cache)._evict_components, walk),
        },
    )
    return walk


__all__ = [
    "ExtendRoom",
    "LaneDemandParams",
    "LoadDemand",
    "load_back_view",
    "planned_walk",
]
