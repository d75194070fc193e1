"""The fleet's L3: object keys without owners, a page written once (imports no SGLang).

Keys are the plugin's own (``core.storage_keys.StorageNamespace.object_key``): a page's
hash chain, its component and the namespace, nothing of the instance, the rank or the cp
size, so a page one instance wrote is a hit for every instance that shares the store. A
page whose every component is already stored is not written again (the writer counts it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Set, Tuple

from sglang_cp_hicache.core.storage_keys import DRAFT_INDEXER, DRAFT_KV, INDEXER, KV, StorageNamespace

#: Bytes per token per layer of the simulator's DSA stack (``testing/v0_5_23/rank_stack.py``:
#: a bf16 MLA latent of 512 + 64 rope, and the indexer's 128 fp8 keys plus one fp32 scale
#: per 128), so the fleet's bytes read like the single-instance run's; an fp8 deployment's
#: packed row is 656 bytes (``testing/v0_5_23/flashmla_kv_reference.py``).
KV_CACHE_DIM, KV_ROW_BYTES, INDEXER_ROW_BYTES = 576, 576 * 2, 128 + 4


def page_bytes(layer_num: int, page_size: int, draft: bool) -> int:
    """Bytes of one stored page over every component (the draft: one more layer)."""
    layers = layer_num + (1 if draft else 0)
    return layers * page_size * (KV_ROW_BYTES + INDEXER_ROW_BYTES)


def components(draft: bool) -> Tuple[str, ...]:
    return (KV, INDEXER, DRAFT_KV, DRAFT_INDEXER) if draft else (KV, INDEXER)


@dataclass
class L3Store:
    """One store's objects (unbounded: the fleet figures measure reuse, not L3 capacity)."""

    namespace: StorageNamespace
    parts: Tuple[str, ...]
    objects: Set[str] = field(default_factory=set)

    def holds(self, page_hash: str) -> bool:
        """A page hits only when every component it needs is stored."""
        return all(self.namespace.object_key(part, page_hash) in self.objects for part in self.parts)

    def match(self, chain: Sequence[str], start: int) -> int:
        """The end of the run of ``chain[start:]`` stored (a prefetch reads no further)."""
        end = start
        while end < len(chain) and self.holds(chain[end]):
            end += 1
        return end

    def put(self, page_hash: str) -> bool:
        """Store the page's objects; False (nothing written) when it was stored already."""
        if self.holds(page_hash):
            return False
        self.objects.update(self.namespace.object_keys(part, [page_hash])[0] for part in self.parts)
        return True


__all__ = ["INDEXER_ROW_BYTES", "KV_CACHE_DIM", "KV_ROW_BYTES", "L3Store", "components", "page_bytes"]
