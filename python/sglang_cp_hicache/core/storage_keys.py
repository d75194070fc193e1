"""L3 storage keys without owners, and the logical progress of an owned-subset read.

Under CP shared KV every rank holds each new token's full KV before the store, so one host
page's bytes depend on its tokens, the model, the KV format and the host layout, never on
which rank owns it or on the cp size. An object key is therefore

    ``<page hash>.<component>__<namespace id>``

* the page hash: SGLang's storage hash chain (0.5.23 seeds it with the request's
  ``extra_key`` / ``cache_salt``, ``mem_cache/utils.py:get_storage_hash_str``);
* the component: one of :data:`COMPONENTS` (each is its own object; a page hits only when
  every component it needs is present);
* the namespace id: a digest of :class:`StorageNamespace` (model, KV dtype, per-token KV
  width, layer count, host layout, page size, extra tag, format version).

Nothing of cp size, cp rank or owner enters a key, so a restart at another cp size reads
the same objects with fresh owners. Imports no SGLang.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

#: Bumped when the byte format of a stored page changes.
FORMAT_VERSION = 1

KV = "kv"
INDEXER = "indexer"
DRAFT_KV = "draft_kv"
DRAFT_INDEXER = "draft_indexer"
COMPONENTS: Tuple[str, ...] = (KV, INDEXER, DRAFT_KV, DRAFT_INDEXER)

_NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class StorageNamespace:
    """What, besides a page's tokens, decides its stored bytes.

    Two namespaces that differ in any field never share an object: a model or layout with
    the same page geometry (GLM-5 and DeepSeek-V3.2 both store 656-byte fp8 MLA rows;
    ``layer_first`` and ``page_first`` pages have the same size) reads as a miss.
    """

    model: str
    kv_dtype: str
    kv_cache_dim: int
    layer_num: int
    host_layout: str
    page_size: int
    extra: str = ""  # e.g. a deployment tag; the request's salt is in the hash chain
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a storage namespace needs a model name")
        for name in ("kv_cache_dim", "layer_num", "page_size", "format_version"):
            if getattr(self, name) <= 0:
                raise ValueError(f"storage namespace {name} must be positive")

    @property
    def namespace_id(self) -> str:
        """A short, stable digest of every field (hex, 16 characters)."""
        text = "|".join(
            f"{name}={getattr(self, name)}"
            for name in (
                "format_version", "model", "kv_dtype", "kv_cache_dim", "layer_num",
                "host_layout", "page_size", "extra",
            )
        )  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def key_suffix(self) -> str:
        """What every object key of this namespace ends with."""
        return f"{_NAMESPACE_SEPARATOR}{self.namespace_id}"

    def object_key(self, component: str, page_hash: str) -> str:
        """The key of one component of one page."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown storage component {component!r}; one of {COMPONENTS}")
        if not page_hash or "." in page_hash or _NAMESPACE_SEPARATOR in page_hash:
            raise ValueError(f"not a page hash: {page_hash!r}")
        return f"{page_hash}.{component}{self.key_suffix}"

    def object_keys(self, component: str, page_hashes: Sequence[str]) -> list[str]:
        return [self.object_key(component, page_hash) for page_hash in page_hashes]


def logical_pages_completed(owned: Sequence[bool], owned_pages_read: int) -> int:
    """Logical pages of a run a rank may report done after reading its owned pages.

    ``owned[i]``: whether this rank owns page ``i`` of the run; ``owned_pages_read``: how
    many of its owned pages, in order, read back whole (every component). The answer is the
    logical index of its first owned page that failed, or the whole run when none failed
    (vacuously for a rank that owns nothing). The MIN of this over the ranks is the longest
    prefix every page of which was read by its owner, since each page has one owner.
    """
    owned_total = sum(1 for flag in owned if flag)
    if not 0 <= owned_pages_read <= owned_total:
        raise ValueError(f"{owned_pages_read} owned pages read of {owned_total} owned")
    if owned_pages_read == owned_total:
        return len(owned)
    seen = 0
    for index, flag in enumerate(owned):
        if flag:
            if seen == owned_pages_read:
                return index
            seen += 1
    raise AssertionError("unreachable: fewer owned pages than counted")


def component_of_pool(pool_name: Optional[str]) -> str:
    """The storage component of an SGLang host pool name (``PoolName`` values): ``kv``,
    ``indexer``, ``draft`` and ``draft_indexer``; anything else is refused."""
    mapping = {None: KV, "": KV, "kv": KV, "__default__": KV, "indexer": INDEXER,
               "draft": DRAFT_KV, "draft_indexer": DRAFT_INDEXER}  # fmt: skip
    if pool_name not in mapping:
        raise ValueError(f"no storage component for host pool {pool_name!r}")
    return mapping[pool_name]


__all__ = [
    "COMPONENTS",
    "DRAFT_INDEXER",
    "DRAFT_KV",
    "FORMAT_VERSION",
    "INDEXER",
    "KV",
    "StorageNamespace",
    "component_of_pool",
    "logical_pages_completed",
]
