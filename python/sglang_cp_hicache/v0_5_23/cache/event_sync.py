"""The HiCache event check's MIN all-reduce, skipped by every rank together when nothing is
in flight.

SGLang 0.5.23's ``check_hicache_events`` runs ``_sync_hicache_ready_counts`` on every
scheduler step: one MIN all-reduce over the attention CP group of the ready write and load
acks, the L3 queue sizes and the write-back reclaim digest pair
(``unified_radix_cache.py:3412-3470``), idle steps included; at cp 2 on the CPU box it is
65-99 % of an idle check (``docs/benchmarks.md``). Under the flag, on a cache with an
extension, :func:`sync_ready_counts_around` answers the check itself, with nothing ready,
when :func:`nothing_in_flight` holds: no write-through pending (``ongoing_write_through``,
the per-layer backups' tickets included), no load-back pending (``ongoing_load_back``), no
L3 tier, buffer pipeline or external linker (their queues are filled by rank-local threads,
so only a reduce can say when they are ready).

Why every rank takes the same branch: the decision reads replicated state only. Every rank
makes the same logical backups and load-backs (host slots from the replicated logical slot
allocator, the same tree), so the pending maps hold the same ids on every rank at every
check (the simulator hashes them into its decision log per batch, and
``test/registered/multi_rank/v0_5_23/cache/test_event_sync_multi_rank.py`` drives ranks whose
acks land at different times); rank-local state (how many acks this rank's copies have
finished) never enters it. No collective is added, and the skipped reduce could only have
returned zeros: no ack is queued for a write or load that is not pending. The reclaim digest
is cumulative, so the next reduce still checks it.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

#: What ``_sync_hicache_ready_counts`` returns with nothing ready and no L3 tier.
NOTHING_READY: Tuple[int, int, Tuple[int, ...], Tuple[str, ...]] = (0, 0, (), ())


def nothing_in_flight(cache: Any) -> bool:
    """No logical write or load pending on ``cache`` and no queue filled by a rank-local
    thread: the same answer on every rank of the group."""
    return (
        not cache.ongoing_write_through
        and not cache.ongoing_load_back
        and not cache.enable_storage
        and cache.buffer_pipeline is None
        and cache.linker is None
        and cache.pp_size == 1
    )


def sync_ready_counts_around(original: Callable, cache: Any) -> Any:
    """``UnifiedRadixCache._sync_hicache_ready_counts``: nothing ready, without the
    all-reduce, when nothing is in flight on a cache with an extension; else upstream's."""
    if extension_of(cache) is not None and nothing_in_flight(cache):
        return NOTHING_READY
    return original(cache)


__all__ = ["NOTHING_READY", "nothing_in_flight", "sync_ready_counts_around"]
