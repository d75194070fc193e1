"""Checks of one 0.5.23 rank, run outside the timed path: the KV pattern the "forward"
writes, hit verification and load poisoning on this rank's owned physical rows, the radix
tree digest, and the rotation invariant of the sharded tree.

The tree digest hashes what must be identical on every rank of a shard group: structure
(keys, node ids), residency, the *logical* device and host locs, lock refs and rotation
bases. Physical state is never hashed.
"""

from __future__ import annotations

import hashlib
from typing import Any, List, Tuple

import numpy as np
import torch

from sglang_cp_hicache.core.rotation import lane_of, owner_of
from sglang_cp_hicache.sim.engine import TreeSummary
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack

# The DSA indexer's paged buffer: per page, ``page_size`` keys of 128 B, then as many
# 4-byte scales (the layout ``DSATokenToKVPool.index_k_with_scale_buffer`` stores).
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4
INDEX_BYTES_PER_TOKEN = INDEX_HEAD_DIM + INDEX_SCALE_BYTES
# Never produced by the pattern: KV values are in [-125, 125]; an index row of the
# pattern is a shifted arange, never a constant byte.
_POISON_KV = 127.0
_POISON_INDEX_BYTE = 0xEE


def expected_kv_rows(
    token_ids: torch.Tensor, positions: torch.Tensor, layer: int, dim: int
) -> torch.Tensor:
    """MLA latent rows ``[n, 1, dim]`` (bf16-exact small integers) of the given tokens."""
    base = (token_ids.to(torch.int64) * 31 + positions.to(torch.int64) * 17 + layer * 7) % 97
    values = (base.unsqueeze(1) + torch.arange(dim)) % 251 - 125
    return values.to(torch.bfloat16).unsqueeze(1)


def expected_index_bytes(
    token_ids: torch.Tensor, positions: torch.Tensor, layer: int
) -> torch.Tensor:
    """Indexer K + scale bytes per token, uint8 ``[n, 132]``."""
    base = (token_ids.to(torch.int64) * 13 + positions.to(torch.int64) * 7 + layer * 3) % 256
    return ((base.unsqueeze(1) + torch.arange(INDEX_BYTES_PER_TOKEN)) % 256).to(torch.uint8)


def _index_byte_offsets(
    physical_rows: torch.Tensor, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page, [132 byte offsets]) of each row in the paged index-K buffer."""
    pages = physical_rows // page_size
    offsets = physical_rows % page_size
    k_cols = offsets.unsqueeze(1) * INDEX_HEAD_DIM + torch.arange(INDEX_HEAD_DIM)
    scale_base = page_size * INDEX_HEAD_DIM + offsets.unsqueeze(1) * INDEX_SCALE_BYTES
    scale_cols = scale_base + torch.arange(INDEX_SCALE_BYTES)
    return pages, torch.cat([k_cols, scale_cols], dim=1)


def owned_rows(stack: RankStack, logical_locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(positions into ``logical_locs`` this rank stores, their physical rows)."""
    locs = logical_locs.to(torch.int64)
    positions = torch.nonzero(stack.owned_mask(locs)).squeeze(1)
    return positions, stack.physical_rows(locs)


def write_prefill_kv(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """What the forward stores on this rank: its owned rows' MLA KV and indexer K/scale."""
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned) == 0:
        return
    pool = stack.kv_pool
    pages, cols = _index_byte_offsets(rows, pool.page_size)
    dim = stack.config.kv_cache_dim
    for layer in range(pool.layer_num):
        tokens, at = token_ids[owned], positions[owned]
        pool.kv_buffer[layer][rows] = expected_kv_rows(tokens, at, layer, dim)
        pool.index_k_with_scale_buffer[layer][pages.unsqueeze(1), cols] = expected_index_bytes(tokens, at, layer)


def store_prefill_layer(
    stack: RankStack, layer: Any, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """Layer ``layer`` (a ``RadixAttention``) of one forward's stores, as the model issues
    them: the DSA indexer's K/scale bytes of this rank's owned rows, then the MLA latent of
    every new slot of the batch in one call of the pool's own ``set_mla_kv_buffer`` (the
    sharded pool keeps its owned rows; the plugin's store hook reports the layer there, on
    every rank, also one owning none of the slots). Same bytes as :func:`write_prefill_kv`."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = stack.kv_pool
    layer_id = layer.layer_id
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned):
        pages, cols = _index_byte_offsets(rows, pool.page_size)
        index_bytes = expected_index_bytes(token_ids[owned], positions[owned], layer_id)
        pool.index_k_with_scale_buffer[layer_id][pages.unsqueeze(1), cols] = index_bytes
    latent = expected_kv_rows(token_ids, positions, layer_id, stack.config.kv_cache_dim)
    rank = stack.config.kv_lora_rank
    pool.set_mla_kv_buffer(layer, KVWriteLoc(logical_locs), latent[..., :rank], latent[..., rank:])


def poison_owned(stack: RankStack, logical_locs: torch.Tensor) -> None:
    """Overwrite this rank's owned rows of ``logical_locs`` (KV and indexer bytes, every
    layer, the MTP draft's too), so only a real host-to-device copy restores them."""
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned) == 0:
        return
    pages, cols = _index_byte_offsets(rows, stack.config.page_size)
    for pool in (stack.kv_pool, stack.draft_kv_pool):  # the draft's rows load with the target's
        if pool is None:
            continue
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer][rows] = _POISON_KV
            pool.index_k_with_scale_buffer[layer][pages.unsqueeze(1), cols] = _POISON_INDEX_BYTE


def verify_hit(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> Tuple[int, int]:
    """(mismatched owned tokens, owned tokens checked) of a prefix hit at positions 0..n-1."""
    return _verify_pool_hit(stack, stack.kv_pool, 0, logical_locs, token_ids)


def _verify_pool_hit(
    stack: RankStack, pool: Any, pattern_base: int, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> Tuple[int, int]:
    """(owned tokens with a wrong KV or indexer byte in ``pool``, owned tokens checked) of a
    hit at positions 0..n-1; ``pool``'s layer ``i`` holds pattern layer ``pattern_base + i``."""
    if len(logical_locs) == 0:
        return 0, 0
    positions = torch.arange(len(logical_locs))
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned) == 0:
        return 0, 0
    pages, cols = _index_byte_offsets(rows, pool.page_size)
    dim = stack.config.kv_cache_dim
    tokens, at = token_ids[owned], positions[owned]
    bad = torch.zeros(len(owned), dtype=torch.bool)
    for layer in range(pool.layer_num):
        pattern = pattern_base + layer
        kv = pool.kv_buffer[layer][rows]
        bad |= (kv != expected_kv_rows(tokens, at, pattern, dim)).reshape(len(owned), -1).any(dim=1)
        index_bytes = pool.index_k_with_scale_buffer[layer][pages.unsqueeze(1), cols]
        bad |= (index_bytes != expected_index_bytes(tokens, at, pattern)).any(dim=1)
    return int(bad.sum()), len(owned)


# ------------------------------------------------------------------ the MTP draft
# The draft's pattern uses layer ids past the target's (its host tail layers,
# ``layer_num + i``), so its bytes differ from every target layer's: a host tail holding
# the target's last layer, or a target-only load-back, reads as a draft mismatch.


def _draft_pattern_layer(stack: RankStack, draft_layer: int) -> int:
    return stack.config.layer_num + draft_layer


def write_draft_kv(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """What the MTP draft's forward stores on this rank: its owned rows in the draft pool."""
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned) == 0:
        return
    pool = stack.draft_kv_pool
    pages, cols = _index_byte_offsets(rows, pool.page_size)
    tokens, at = token_ids[owned], positions[owned]
    for layer in range(pool.layer_num):
        pattern = _draft_pattern_layer(stack, layer)
        pool.kv_buffer[layer][rows] = expected_kv_rows(tokens, at, pattern, stack.config.kv_cache_dim)
        pool.index_k_with_scale_buffer[layer][pages.unsqueeze(1), cols] = expected_index_bytes(tokens, at, pattern)


def store_draft_layer(
    stack: RankStack, layer: Any, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor
) -> None:
    """The draft forward's layer ``layer`` (a ``RadixAttention`` with the draft pool's layer
    id) stores, through the draft pool's own ``set_mla_kv_buffer`` (the plugin's store hook
    reports it to the per-layer backup's draft stage). Same bytes as :func:`write_draft_kv`."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = stack.draft_kv_pool
    pattern = _draft_pattern_layer(stack, layer.layer_id)
    owned, rows = owned_rows(stack, logical_locs)
    if len(owned):
        pages, cols = _index_byte_offsets(rows, pool.page_size)
        index_bytes = expected_index_bytes(token_ids[owned], positions[owned], pattern)
        pool.index_k_with_scale_buffer[layer.layer_id][pages.unsqueeze(1), cols] = index_bytes
    latent = expected_kv_rows(token_ids, positions, pattern, stack.config.kv_cache_dim)
    rank = stack.config.kv_lora_rank
    pool.set_mla_kv_buffer(layer, KVWriteLoc(logical_locs), latent[..., :rank], latent[..., rank:])


def verify_draft_hit(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> Tuple[int, int]:
    """(owned tokens with wrong draft KV/indexer bytes, owned tokens checked) of a hit."""
    first_pattern = _draft_pattern_layer(stack, 0)
    return _verify_pool_hit(stack, stack.draft_kv_pool, first_pattern, logical_locs, token_ids)


def draft_bytes_per_token(stack: RankStack) -> int:
    """The draft's share of the host pools' bytes per token: its tail layers (upstream
    packs the draft in the target's host slots, so every pool's layers include them)."""
    draft = stack.config.draft_layer_num
    return sum(
        entry.host_pool.size_per_token * draft // entry.host_pool.layer_num
        for entry in stack.host_pool_group.entry_map.values()
    )


# ----------------------------------------------------------------------- the tree
def _ints(values: Any) -> bytes:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).numpy().tobytes()
    return np.asarray(values, dtype=np.int64).tobytes()


def _walk(cache: Any):
    """(node, depth in tokens) of every node, children in a rank-independent order."""
    root = cache.tree_core.root_node
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        length = 0 if node.key is None else len(node.key)
        children = sorted(node.children.items(), key=lambda item: repr(item[0]))
        for _, child in reversed(children):
            stack.append((child, depth + length))


def tree_summary(cache: Any) -> TreeSummary:
    """Digest of the logical tree (keys, ids, residency, logical locs, lock refs,
    rotation bases), and its device and host token counts."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    digest = hashlib.sha256()
    nodes = device_tokens = host_tokens = 0
    root = cache.tree_core.root_node
    for node, depth in _walk(cache):
        nodes += 1
        full = node.component_data[ComponentType.FULL]
        key_ids = [] if node.key is None else list(node.key.raw_token_ids())
        has_value, has_host = full.value is not None, full.host_value is not None
        digest.update(
            repr(
                (node.id, depth, len(key_ids), has_value, has_host, full.lock_ref,
                 full.host_lock_ref, node.rotation_base)
            ).encode()  # fmt: skip
        )
        digest.update(_ints(key_ids))
        if has_value and node is not root:
            digest.update(b"v" + _ints(full.value))
            device_tokens += len(full.value)
        if has_host:
            digest.update(b"h" + _ints(full.host_value))
            host_tokens += len(full.host_value)
    return TreeSummary(digest.hexdigest()[:32], nodes, device_tokens, host_tokens)


def rotation_problems(cache: Any, shard_size: int, page_size: int) -> List[str]:
    """Sharded trees: every device node's page owners continue its chain's rotation,
    ``owner_of(rotation_base, P)`` for position-page P (``core.rotation``), the contract the prefix gather and
    the scratch translation rely on (``allocator/page_interleave.py``)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    problems: List[str] = []
    root = cache.tree_core.root_node
    for node, depth in _walk(cache):
        value = node.component_data[ComponentType.FULL].value
        if node is root or value is None or len(value) == 0:
            continue
        if node.rotation_base is None:
            problems.append(f"node {node.id}: device KV without a rotation base")
            continue
        owners = lane_of(value[::page_size].to(torch.int64) // page_size, shard_size)
        first = depth // page_size
        expected = owner_of(node.rotation_base, first + torch.arange(len(owners)), shard_size)
        if not torch.equal(owners, expected):
            problems.append(
                f"node {node.id}: page owners {owners.tolist()} break rotation base "
                f"{node.rotation_base} from position-page {first}"
            )
    return problems
