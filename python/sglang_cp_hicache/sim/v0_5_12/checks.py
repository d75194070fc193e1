"""Checks run outside the timed path: radix-tree digest, KV poisoning and verification.

The tree digest hashes everything that must be identical on all CP ranks: structure
(keys, node ids), residency (device / host) and the *logical* device and host locs,
which CP shared KV keeps replicated by design. Physical state is never hashed.
"""

from __future__ import annotations

import hashlib
from typing import Any, Tuple

import numpy as np
import torch

from sglang_cp_hicache.sim.engine import TreeSummary
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import (
    RankStack,
    _index_byte_offsets,
    count_draft_kv_mismatches,
    count_kv_mismatches,
    owned_physical,
)

# Never produced by the pattern: KV values are in [-125, 125]; an index row of the
# pattern is a shifted arange, never a constant byte.
_POISON_KV = 127.0
_POISON_INDEX_BYTE = 0xEE


def _ints(values: Any) -> bytes:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).numpy().tobytes()
    return np.asarray(values, dtype=np.int64).tobytes()


def tree_summary(cache: Any) -> TreeSummary:
    """Digest of the radix tree in a rank-independent order (children sorted by key)."""
    digest = hashlib.sha256()
    nodes = device_tokens = host_tokens = 0
    stack = [(cache.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        has_value = node.value is not None
        has_host = getattr(node, "host_value", None) is not None
        key_ids = node.key.token_ids if node.key is not None else []
        digest.update(
            repr((node.id, depth, len(key_ids), has_value, has_host, node.lock_ref)).encode()
        )
        digest.update(_ints(key_ids))
        if has_value and node is not cache.root_node:
            digest.update(b"v" + _ints(node.value))
            device_tokens += len(node.value)
        if has_host:
            digest.update(b"h" + _ints(node.host_value))
            host_tokens += len(node.host_value)
        # .items() only: TreeNode.children is a defaultdict, a lookup would create nodes.
        children = sorted(node.children.items(), key=lambda item: repr(item[0]))
        for _, child in reversed(children):
            stack.append((child, depth + 1))
    return TreeSummary(digest.hexdigest()[:32], nodes, device_tokens, host_tokens)


def poison_owned(stack: RankStack, logical_locs: torch.Tensor) -> None:
    """Overwrite this rank's owned slots of ``logical_locs`` (target pool, and the draft's)
    so only a real load restores them."""
    owned, physical_locs = owned_physical(stack, logical_locs)
    if len(owned) == 0:
        return
    # Same byte addressing as the pattern writer, so exactly the checked bytes are poisoned.
    for pool in (stack.kv_pool, stack.draft_pool):
        if pool is None:
            continue
        pages, cols = _index_byte_offsets(physical_locs, pool.page_size)
        for layer in range(pool.layer_num):
            pool.kv_buffer[layer][physical_locs] = _POISON_KV
            index_buf = pool.index_k_with_scale_buffer[layer]
            index_buf[pages.unsqueeze(1), cols] = _POISON_INDEX_BYTE


def verify_hit(
    stack: RankStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, draft: bool = False
) -> Tuple[int, int]:
    """(mismatched owned tokens, owned tokens checked) of a prefix hit at positions 0..n-1:
    the target's KV, or (``draft``) the MTP draft's."""
    if len(logical_locs) == 0:
        return 0, 0
    positions = torch.arange(len(logical_locs))
    locs = logical_locs.to(torch.int64)
    owned, _ = owned_physical(stack, locs)
    count = count_draft_kv_mismatches if draft else count_kv_mismatches
    return count(stack, locs, token_ids, positions), len(owned)
