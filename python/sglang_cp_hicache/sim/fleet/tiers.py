"""One prefill instance's device and host tiers, as pages of a prefix tree (imports no SGLang).

A page is named by its storage hash chain (:func:`page_hashes`), so a page's name says its
whole prefix, as the radix tree's path does. Both tiers hold whole pages of *logical*
capacity: under CP shared KV an instance of ``cp`` ranks holds ``cp`` x one rank's pool.
Eviction is LRU over leaves (a page whose child is cached stays, so every cached page's
prefix is cached: a match is a walk from the root). HiCache's write-through keeps every
device page on host; host eviction takes only pages no longer on device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


def page_hashes(token_ids: Sequence[int], page_size: int) -> List[str]:
    """The hash chain of every full page of ``token_ids``: page ``i``'s hash covers pages
    ``0..i`` (SGLang's storage hash chain, ``mem_cache/utils.py:get_hash_str``, has the
    same shape: each page's hash seeded with its parent's)."""
    hashes: List[str] = []
    prior = ""
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = ",".join(str(t) for t in token_ids[start : start + page_size])
        prior = hashlib.sha256(f"{prior}|{page}".encode()).hexdigest()[:32]
        hashes.append(prior)
    return hashes


@dataclass
class _Entry:
    parent: Optional[str]
    children: int = 0
    last_use: int = 0


@dataclass
class PageTier:
    """Pages of one tier, at most ``capacity_pages`` after each :meth:`fit`."""

    capacity_pages: int
    entries: Dict[str, _Entry] = field(default_factory=dict)

    def __contains__(self, page: str) -> bool:
        return page in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, chain: Sequence[str], start: int = 0) -> int:
        """The end of the run of ``chain[start:]`` this tier holds (an index into chain)."""
        end = start
        while end < len(chain) and chain[end] in self.entries:
            end += 1
        return end

    def insert(self, chain: Sequence[str], now: int) -> None:
        """Hold every page of ``chain`` (a root path), each last used at ``now``."""
        parent: Optional[str] = None
        for page in chain:
            entry = self.entries.get(page)
            if entry is None:
                entry = self.entries[page] = _Entry(parent)
                if parent is not None:
                    self.entries[parent].children += 1
            entry.last_use = now
            parent = page

    def fit(self, now: int, pinned: "Optional[PageTier]" = None) -> int:
        """Evict least recently used leaves, never one used at ``now`` nor one ``pinned``
        holds, until the tier fits; returns the pages evicted."""
        evicted = 0
        while len(self.entries) > self.capacity_pages:
            victims = [
                (entry.last_use, page)
                for page, entry in self.entries.items()
                if entry.children == 0 and entry.last_use < now and (pinned is None or page not in pinned)
            ]
            if not victims:
                break  # what is left is in use this step (the batch fits, plan_steps checks)
            _, page = min(victims)
            parent = self.entries.pop(page).parent
            if parent is not None:
                self.entries[parent].children -= 1
            evicted += 1
        return evicted


@dataclass
class InstanceTiers:
    """Device and host of one instance; host holds every device page (write-through)."""

    device: PageTier
    host: PageTier

    @classmethod
    def sized(cls, cp_size: int, physical_tokens: int, hicache_ratio: float, page_size: int) -> "InstanceTiers":
        """Logical capacity of ``cp_size`` ranks, each with ``physical_tokens`` on device and
        ``hicache_ratio`` x that on host (the simulator's per-rank pools)."""
        device_pages = cp_size * physical_tokens // page_size
        return cls(PageTier(device_pages), PageTier(int(device_pages * hicache_ratio)))

    def match(self, chain: Sequence[str]) -> "tuple[int, int]":
        """``(device_end, host_end)``: the device prefix, then what host adds after it."""
        device_end = self.device.match(chain)
        return device_end, self.host.match(chain, device_end)

    def hold(self, chain: Sequence[str], now: int) -> None:
        """The request's pages on device and (backed up) on host; then both tiers fit."""
        self.device.insert(chain, now)
        self.host.insert(chain, now)
        self.device.fit(now)
        self.host.fit(now, pinned=self.device)


__all__ = ["InstanceTiers", "PageTier", "page_hashes"]
