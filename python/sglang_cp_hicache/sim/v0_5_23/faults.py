"""Planted bugs (``SimConfig.fault``) on the 0.5.23 line: each one must make a checker fail.

They patch this rank's process and stack only (each rank is its own process), and only on
the sharded columns. :data:`SUPPORTED` lists the faults this line plants; the other
(``shift_mirror``) is a 0.5.12.post1 seam and refused here.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang_cp_hicache.sim.engine import FaultHooks, plant_match_prefix_barrier
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack

logger = logging.getLogger(__name__)

SUPPORTED = frozenset(
    ("roll_load_owners", "drop_last_rank_loads", "hot_path_barrier", "diverge_last_rank", "leak_tail")
) | {"pd_wrong_owner"}  # planted by the PD prefill role in upstream's filter (sim/v0_5_23/pd.py)
SUPPORTED |= {"storage_wrong_bytes"}  # planted in the L3 tier's reads (sim/v0_5_23/storage.py)
#: Faults planted in the per-layer D2H backup (the plugin column with per_layer_backup).
PER_LAYER_FAULTS = frozenset(("early_layer_ack", "skip_backup_layer", "early_l3_write"))
SUPPORTED |= PER_LAYER_FAULTS
SUPPORTED |= {"drop_last_rank_draft_loads"}  # the packed MTP draft's loads (SimConfig.draft)
SUPPORTED |= {"pd_drop_draft"}  # planted on the PD link's engine (sim/v0_5_23/pd_link.py)


def apply_fault(name: Optional[str], stack: RankStack, cp_group: Any, num_steps: int) -> FaultHooks:
    hooks = FaultHooks()
    if name is None:
        return hooks
    if name not in SUPPORTED:  # LINE.check refuses it before any rank starts
        raise ValueError(f"fault {name!r} is not planted on the 0.5.23 line")
    logger.warning("rank %d: planted fault %r is active", stack.shard_rank, name)
    last_rank = stack.shard_rank == stack.shard_size - 1
    if name == "roll_load_owners":
        _roll_load_owners(stack)
    elif name == "drop_last_rank_loads" and last_rank:
        # The copies vanish but the load still acks: the device rows keep their poison.
        for entry in stack.host_pool_group.entry_map.values():
            entry.host_pool.load_to_device_per_layer_physical = lambda *a, **k: None
    elif name == "drop_last_rank_draft_loads" and last_rank:
        _drop_draft_loads(stack)
    elif name == "hot_path_barrier":
        plant_match_prefix_barrier(stack.cache, cp_group)
    elif name == "diverge_last_rank" and last_rank:
        hooks.extra_eviction_at_step = num_steps // 2
    elif name == "leak_tail":
        _drop_partial_page_frees(stack)
    elif name in PER_LAYER_FAULTS:
        _plant_in_layer_backup(name, stack, last_rank)
    return hooks


def _plant_in_layer_backup(name: str, stack: RankStack, last_rank: bool) -> None:
    """``early_layer_ack``: the last rank's pipeline counts one layer less, so it acks after
    the forward's last-but-one layer and takes the last one for a forward with nothing held.
    ``skip_backup_layer``: the store hook's report of layer 0 is lost on every rank (so the
    ranks stop together), the next layer arrives first. ``early_l3_write``: every rank sends
    a node to L3 (upstream's ``write_backup_storage``) as soon as its insert claims reserved
    host slots, before the per-layer backup's ack. The native column has no backup."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    backup = layer_backup_of(stack.cache)
    if backup is None:
        return
    if name == "early_layer_ack" and last_rank:
        backup.pipeline.layer_num -= 1
    elif name == "skip_backup_layer":
        layer_stored = backup.layer_stored

        def drop_layer0(layer_id: int, num_locs: int) -> None:
            if layer_id != 0:
                layer_stored(layer_id, num_locs)

        backup.layer_stored = drop_layer0
    elif name == "early_l3_write":
        tracked, cache = backup.tracked, stack.cache

        def write_at_claim(node_id: int) -> None:
            cache.write_backup_storage(node_id)  # upstream writes to L3 at the ack, not here
            tracked(node_id)

        backup.tracked = write_at_claim


def _drop_draft_loads(stack: RankStack) -> None:
    """The last rank's load-backs copy the target's layers but not the packed draft's tail
    layer (upstream's ``L2Transfer.is_draft`` copies): the draft rows keep their poison
    behind a good target hit."""
    for entry in stack.host_pool_group.entry_map.values():
        host_pool = entry.host_pool
        load = host_pool.load_to_device_per_layer_physical

        def target_only(*args, is_draft: bool = False, _load=load, **kwargs):
            if not is_draft:
                return _load(*args, **kwargs)
            return None

        host_pool.load_to_device_per_layer_physical = target_only


def _roll_load_owners(stack: RankStack) -> None:
    """Load-backs allocate their device pages one owner class late.

    The controller keeps a loaded page's owner by starting the device chain at the host
    copy's class (``hybrid_cache_controller.py:1035-1040``); rolling it pairs each host page
    with a device page of the next rank, so every rank copies its host rows into rows it
    does not own, and the owners' rows keep their poison.
    """
    allocator = stack.allocator
    alloc_cyclic = allocator.alloc_cyclic

    def rolled(start_class: int, need_size: int):
        return alloc_cyclic(start_class=start_class + 1, need_size=need_size)

    allocator.alloc_cyclic = rolled


def _drop_partial_page_frees(stack: RankStack) -> None:
    """Frees shorter than a page (the unaligned tail ``release_kv_cache`` gives back after
    the page-aligned insert) are lost; whole-page frees pass."""
    allocator = stack.allocator
    free = allocator.free

    def free_whole_pages_only(indices):
        if 0 < len(indices) < allocator.page_size:
            return None
        return free(indices)

    allocator.free = free_whole_pages_only
