"""Hooks on SGLang's batch allocation (extends ``sglang.srt.mem_cache.common``).

``alloc_for_extend`` / ``alloc_for_decode`` allocate a batch's KV locs and write them into
``req_to_token``. Under CP HiCache the same locs are written into the cache's
:class:`ReqToTokenHostMirror`, from host state only (no device read-back):

* prefix positions of a request new to its req slot: the device path of its last node
  (the nodes' host locs), which is exactly the ``prefix_indices`` the match (and load-back)
  returned; a request keeping its slot (chunked prefill) already has them in its row,
  kept current by ``CpHiRadixCache.cache_unfinished_req``;
* new positions: the pages the CP allocator took (host NumPy, recorded during the call),
  expanded with the allocator's own layout (:func:`extend_token_locs_host`).

``alloc_for_extend`` then leaves on the batch (``LOGICAL_PAGES_ATTR``) a snapshot of each
request's logical page ids taken from those rows: what the batch's forward reads from
``req_to_token``, even if a later scheduling step (overlap scheduler) rewrites the rows.
``managers/schedule_batch.py`` and ``model_executor/forward_batch_info.py`` carry it to the
forward, whose shared-KV page mapping then reads nothing back from the device.

Replicated logical state: every rank computes the same rows; no collective. Only the
plugin's CP-mode cache has a mirror (:func:`cp_hicache_of`, by type, the cache inside SGLang's
``StreamingSession`` included); with any other cache (flag off, CP without HiCache, a
``MagicMock`` of upstream's tests) both hooks are upstream's functions unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import numpy as np

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import CpHiCacheMetadataError
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import extend_token_locs_host
from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR
from sglang_cp_hicache.v0_5_12.own_objects import cp_hicache_of
from sglang_cp_hicache.v0_5_12.server_args import CLI_FLAG, CpSharedKVConfigError


def alloc_for_extend_around(original: Callable, batch: Any):
    """AROUND hook of ``sglang.srt.mem_cache.common.alloc_for_extend``."""
    cache = cp_hicache_of(batch.tree_cache)
    if cache is None:
        return original(batch)
    mirror = cache.req_loc_mirror
    had_slot = [req.req_pool_idx is not None for req in batch.reqs]
    with cache.token_to_kv_pool_allocator.recording_new_pages() as taken:
        result = original(batch)
    _mirror_extend(cache, batch, had_slot, taken)
    _, _, req_pool_indices = result
    setattr(
        batch,
        LOGICAL_PAGES_ATTR,
        mirror.batch_logical_pages(req_pool_indices, host_int64(batch.seq_lens_cpu), cache.page_size),
    )
    return result


def alloc_for_decode_around(original: Callable, batch: Any, token_per_req: int):
    """AROUND hook of ``sglang.srt.mem_cache.common.alloc_for_decode``."""
    cache = cp_hicache_of(batch.tree_cache)
    if cache is None:
        return original(batch, token_per_req=token_per_req)
    if token_per_req != 1 or batch.model_config.is_encoder_decoder:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} with HiCache decodes one token per request of a decoder-only model "
            f"(got token_per_req={token_per_req})"
        )
    with cache.token_to_kv_pool_allocator.recording_new_pages() as taken:
        out_cache_loc = original(batch, token_per_req=token_per_req)
    _mirror_decode(cache, batch, taken)
    return out_cache_loc


def _mirror_extend(cache: Any, batch: Any, had_slot: Sequence[bool], taken: List[np.ndarray]) -> None:
    mirror, page_size = cache.req_loc_mirror, cache.page_size
    prefix_lens = np.asarray(batch.prefix_lens, dtype=np.int64)
    seq_lens = host_int64(batch.seq_lens_cpu)
    last_locs = np.full(len(batch.reqs), -1, dtype=np.int64)
    for i, req in enumerate(batch.reqs):
        prefix_len = int(prefix_lens[i])
        if not had_slot[i]:
            prefix = cache.device_prefix_locs(req.last_node)
            if len(prefix) != prefix_len:
                raise CpHiCacheMetadataError(
                    f"request {getattr(req, 'rid', '?')}: its prefix has {prefix_len} locs but "
                    f"the device path of its last node {req.last_node.id} has {len(prefix)}"
                )
            mirror.write(req.req_pool_idx, 0, prefix)
        if prefix_len:
            last_locs[i] = mirror.row(req.req_pool_idx)[prefix_len - 1]
    new_pages = np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)
    try:
        new_locs = extend_token_locs_host(prefix_lens, seq_lens, last_locs, new_pages, page_size)
    except ValueError as exc:
        raise CpHiCacheMetadataError(f"alloc_for_extend: the allocator's pages: {exc}") from None
    offset = 0
    for req, prefix_len, seq_len in zip(batch.reqs, prefix_lens.tolist(), seq_lens.tolist()):
        mirror.write(req.req_pool_idx, prefix_len, new_locs[offset : offset + seq_len - prefix_len])
        offset += seq_len - prefix_len


def _mirror_decode(cache: Any, batch: Any, taken: List[np.ndarray]) -> None:
    mirror, page_size = cache.req_loc_mirror, cache.page_size
    slots = np.array([req.req_pool_idx for req in batch.reqs], dtype=np.int64)
    positions = host_int64(batch.seq_lens_cpu)  # the new token's position per request
    starts_page = positions % page_size == 0
    new_pages = np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)
    if len(new_pages) != int(starts_page.sum()):
        raise CpHiCacheMetadataError(
            f"alloc_for_decode: the allocator took {len(new_pages)} new pages, the lens need "
            f"{int(starts_page.sum())}"
        )
    locs = mirror.gather(slots, positions - 1) + 1
    locs[starts_page] = new_pages * page_size
    mirror.scatter(slots, positions, locs)
