"""Host-side state of CP HiCache: logical host pages backed by per-rank physical shards.

The radix tree stays logical: a backed-up node's ``host_value`` holds *logical host locs*,
allocated identically on every CP rank, so every upstream length, split, hit and threshold
computation on ``host_value`` is a logical one and ranks never diverge. Each logical host
page remembers the owner lane of the device page it was written from; only that owner
stores it, in a physical page of its own host pool. :class:`CpHostPageTable` is the single
place that maps logical host locs to physical host slots.

Because host pools are per rank and equal-sized, every rank can compute every lane's host
usage from the replicated owner table, so admission (does each lane have room?) and
eviction progress (has each short lane regained enough pages?) are decided identically on
all ranks without a collective.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Tuple

import torch

from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import CpSharedKVLayout


class CpHiCacheMetadataError(RuntimeError):
    """CP HiCache bookkeeping is inconsistent; the message names the node and rank."""


def _as_cpu_int64(values: torch.Tensor) -> torch.Tensor:
    return values.to(device="cpu", dtype=torch.int64)


def unique_pages_in_order(locs: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pages of a loc run in first-seen order, and each loc's index into that page list.

    Radix values list each page's tokens contiguously, so consecutive de-duplication is
    enough and keeps the page order of the run.
    """
    pages, inverse = torch.unique_consecutive(locs // page_size, return_inverse=True)
    return pages, inverse


@dataclass
class CpHiCacheNodeMetadata:
    """What one rank holds on host for one radix node.

    ``owned_positions`` are node-local token positions this rank stores (sorted);
    ``host_indices`` the physical host slots holding them, in the same order;
    ``page_owners`` the owner lane of each of the node's pages (identical on all ranks).
    All tensors are CPU int64. ``logical_len`` counts valid tokens; a trailing partial
    page is still one owner page.
    """

    logical_len: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    page_owners: torch.Tensor
    page_size: int
    node_id: int = -1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        def fail(reason: str) -> None:
            raise CpHiCacheMetadataError(
                f"CP HiCache metadata of node {self.node_id} on CP rank {self.cp_rank}: {reason}"
            )

        for name in ("owned_positions", "host_indices", "page_owners"):
            tensor = getattr(self, name)
            if tensor.device.type != "cpu" or tensor.dtype != torch.int64:
                fail(f"{name} must be a CPU int64 tensor, got {tensor.dtype} on {tensor.device}")
        if self.page_size < 1 or self.logical_len < 0:
            fail(f"page_size={self.page_size}, logical_len={self.logical_len}")
        if len(self.owned_positions) != len(self.host_indices):
            fail(
                f"{len(self.owned_positions)} owned positions but "
                f"{len(self.host_indices)} host indices"
            )
        expected_pages = -(-self.logical_len // self.page_size)
        if len(self.page_owners) != expected_pages:
            fail(f"{len(self.page_owners)} page owners for {expected_pages} pages")
        if len(self.owned_positions):
            if bool((self.owned_positions[1:] <= self.owned_positions[:-1]).any()):
                fail("owned_positions must be strictly increasing")
            if int(self.owned_positions[0]) < 0 or int(self.owned_positions[-1]) >= self.logical_len:
                fail(f"owned_positions out of range [0, {self.logical_len})")
            owner_of_position = self.page_owners[self.owned_positions // self.page_size]
            if bool((owner_of_position != self.cp_rank).any()):
                fail("an owned position lies in a page owned by another rank")

    @property
    def owned_len(self) -> int:
        return len(self.owned_positions)

    def split(self, split_len: int) -> Tuple["CpHiCacheNodeMetadata", "CpHiCacheNodeMetadata"]:
        """Split at a logical offset by page, with position masks (never by slicing).

        A split inside a page would leave one physical page shared by two nodes, so
        ``split_len`` must be a page boundary (or the node's end).
        """
        if not 0 <= split_len <= self.logical_len:
            raise CpHiCacheMetadataError(
                f"node {self.node_id} on CP rank {self.cp_rank}: split_len {split_len} "
                f"outside [0, {self.logical_len}]"
            )
        if split_len % self.page_size and split_len != self.logical_len:
            raise CpHiCacheMetadataError(
                f"node {self.node_id} on CP rank {self.cp_rank}: split_len {split_len} is "
                f"inside a page (page_size {self.page_size})"
            )
        parent_mask = self.owned_positions < split_len
        split_page = -(-split_len // self.page_size)
        common = dict(page_size=self.page_size, node_id=self.node_id, cp_rank=self.cp_rank)
        parent = CpHiCacheNodeMetadata(
            logical_len=split_len,
            owned_positions=self.owned_positions[parent_mask],
            host_indices=self.host_indices[parent_mask],
            page_owners=self.page_owners[:split_page],
            **common,
        )
        child = CpHiCacheNodeMetadata(
            logical_len=self.logical_len - split_len,
            owned_positions=self.owned_positions[~parent_mask] - split_len,
            host_indices=self.host_indices[~parent_mask],
            page_owners=self.page_owners[split_page:],
            **common,
        )
        return parent, child


@dataclass(frozen=True)
class HostWritePlan:
    """Where one logical write goes: the owner of each page and each lane's page need."""

    logical_device_pages: torch.Tensor  # CPU int64, one per page of the node
    page_owners: torch.Tensor  # CPU int64
    lane_pages: torch.Tensor  # CPU int64 [cp_size]


class CpHostPageTable:
    """Logical host pages of one CP rank, with the owner lane and physical page of each.

    Replicated state (identical on every rank): the free list of logical host pages, the
    owner of each used page, and per-lane usage. Per-rank state: the physical host page of
    the pages this rank owns. Invariant: ``lane_used_pages[cp_rank]`` equals the pages this
    rank's physical host pool has handed out for CP HiCache.
    """

    def __init__(self, layout: CpSharedKVLayout, physical_host_pages: int) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.physical_host_pages = physical_host_pages
        self.num_logical_pages = physical_host_pages * layout.cp_size
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        self.free_logical_pages: Deque[int] = deque(range(self.num_logical_pages))
        self.page_owner = torch.full((self.num_logical_pages,), -1, dtype=torch.int64)
        self.physical_page = torch.full((self.num_logical_pages,), -1, dtype=torch.int64)
        # NumPy views of the same memory, for the NumPy load and release planning.
        self.page_owner_np = self.page_owner.numpy()
        self.physical_page_np = self.physical_page.numpy()
        self.lane_used_pages = torch.zeros(self.layout.cp_size, dtype=torch.int64)

    def lane_free_pages(self) -> torch.Tensor:
        return self.physical_host_pages - self.lane_used_pages

    def used_logical_tokens(self) -> int:
        return (self.num_logical_pages - len(self.free_logical_pages)) * self.page_size

    # ------------------------------------------------------------------ write
    def plan_write(self, logical_device_locs: torch.Tensor) -> HostWritePlan:
        pages, _ = unique_pages_in_order(_as_cpu_int64(logical_device_locs), self.page_size)
        owners = self.layout.owner_for_logical_pages(pages)
        lane_pages = torch.bincount(owners, minlength=self.layout.cp_size)
        return HostWritePlan(pages, owners, lane_pages)

    def lane_deficit(self, plan: HostWritePlan) -> torch.Tensor:
        """Pages each lane lacks to admit ``plan`` (all zero: admissible)."""
        return (plan.lane_pages - self.lane_free_pages()).clamp_(min=0)

    def commit_write(
        self, plan: HostWritePlan, owned_physical_host_pages: torch.Tensor
    ) -> torch.Tensor:
        """Record a write admitted by :meth:`lane_deficit`; return its logical host pages."""
        num_pages = len(plan.page_owners)
        logical_pages = torch.tensor(
            [self.free_logical_pages.popleft() for _ in range(num_pages)], dtype=torch.int64
        )
        self.page_owner[logical_pages] = plan.page_owners
        owned = plan.page_owners == self.layout.cp_rank
        self.physical_page[logical_pages[owned]] = _as_cpu_int64(owned_physical_host_pages)
        self.lane_used_pages += plan.lane_pages
        return logical_pages

    # ------------------------------------------------------------------ lookup
    def node_metadata(
        self, logical_host_locs: torch.Tensor, node_id: int = -1
    ) -> CpHiCacheNodeMetadata:
        """This rank's view of a node backed up at ``logical_host_locs``."""
        locs = _as_cpu_int64(logical_host_locs)
        pages, inverse = unique_pages_in_order(locs, self.page_size)
        owners = self.page_owner[pages]
        if bool((owners < 0).any()):
            raise CpHiCacheMetadataError(
                f"node {node_id} on CP rank {self.layout.cp_rank}: logical host page "
                f"{int(pages[owners < 0][0])} is not allocated"
            )
        owned_positions = torch.nonzero(owners[inverse] == self.layout.cp_rank, as_tuple=True)[0]
        owned_locs = locs[owned_positions]
        host_indices = self.physical_page[owned_locs // self.page_size] * self.page_size + (
            owned_locs % self.page_size
        )
        return CpHiCacheNodeMetadata(
            logical_len=len(locs),
            owned_positions=owned_positions,
            host_indices=host_indices,
            page_owners=owners,
            page_size=self.page_size,
            node_id=node_id,
            cp_rank=self.layout.cp_rank,
        )

    def owned_physical_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Physical host pages (this rank) of the owned pages among ``logical_pages``."""
        owned = self.page_owner[logical_pages] == self.layout.cp_rank
        return self.physical_page[logical_pages[owned]]

    # ------------------------------------------------------------------ free
    def release(self, logical_host_locs: torch.Tensor, node_id: int = -1) -> Tuple[torch.Tensor, torch.Tensor]:
        """Free the pages of a node; return (owned physical host pages, per-lane pages freed)."""
        pages, _ = unique_pages_in_order(_as_cpu_int64(logical_host_locs), self.page_size)
        owners = self.page_owner[pages]
        if bool((owners < 0).any()):
            raise CpHiCacheMetadataError(
                f"node {node_id} on CP rank {self.layout.cp_rank}: double free of logical "
                f"host page {int(pages[owners < 0][0])}"
            )
        owned_physical = self.physical_page[pages[owners == self.layout.cp_rank]].clone()
        lane_freed = torch.bincount(owners, minlength=self.layout.cp_size)
        self.page_owner[pages] = -1
        self.physical_page[pages] = -1
        self.lane_used_pages -= lane_freed
        self.free_logical_pages.extend(pages.tolist())
        return owned_physical, lane_freed

    def lane_pages_of(self, logical_host_locs: torch.Tensor) -> torch.Tensor:
        """Per-lane page count of a node, without freeing (eviction planning)."""
        pages, _ = unique_pages_in_order(_as_cpu_int64(logical_host_locs), self.page_size)
        return torch.bincount(self.page_owner[pages], minlength=self.layout.cp_size)


def pages_to_token_locs(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token locs covering whole pages, page by page."""
    offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).reshape(-1)


def expand_valid_locs(
    page_locs: torch.Tensor, template_locs: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Map each ``template`` loc onto the same in-page offset of the matching new page.

    ``page_locs`` are whole-page token locs (one page per page of ``template_locs``, in
    order); the result has ``len(template_locs)`` entries, so a padded tail page is
    transferred but never exposed.
    """
    _, inverse = unique_pages_in_order(template_locs, page_size)
    page_starts = page_locs[::page_size]
    return page_starts[inverse.to(page_starts.device)] + (template_locs % page_size).to(
        page_starts.device
    )


__all__ = [
    "CpHiCacheMetadataError",
    "CpHiCacheNodeMetadata",
    "CpHostPageTable",
    "HostWritePlan",
    "expand_valid_locs",
    "pages_to_token_locs",
    "unique_pages_in_order",
]
