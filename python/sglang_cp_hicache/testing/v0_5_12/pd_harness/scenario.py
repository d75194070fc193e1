"""What every role of one 0.5.12.post1 PD cluster runs (:class:`PDScenario`), the negative
controls planted in the plugin's owner filter, and the pools' buffers the roles compare."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.pd.scenario import ScenarioSteps, Step


PAGE_SIZE = 64
HIDDEN_SIZE = 64  # the metadata buffers' hidden state (MTP: carried to decode)


# ------------------------------------------------------------------ scenario


@dataclass(frozen=True)
class PDScenario(ScenarioSteps):
    """What every role of one cluster runs.

    ``plants`` (negative controls) maps a request id to a bug planted in the plugin's owner
    filter on the prefill ranks while that request is served: ``wrong_owner`` makes each
    rank send the pages of the next rank's lane from its own slots; ``rank_skips_send``
    makes the last rank send no pages (it still reports its status). The decode re-checks a
    planted request at the end apart from the others (``final_planted_kv_mismatches``), so
    one cluster serves both. ``pause_after_chunk`` names a
    request whose prefill ranks stop after their first chunk until the harness answers the
    ``chunk-sent`` checkpoint (the decode-killed fault). ``hold_after_registering``: the
    prefill ranks wait for the harness's ``go`` once registered (the fault cluster's decodes
    start meanwhile).
    """

    cp_size: int
    steps: Tuple[Step, ...]
    draft: bool = False
    layer_num: int = 2
    prefill_pages_per_rank: int = 32
    decode_pages: int = 160
    plants: Tuple[Tuple[str, str], ...] = ()
    pause_after_chunk: Optional[str] = None
    hold_after_registering: bool = False
    transfer_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_plants()


# ------------------------------------------------------------------ negative controls
def _wrong_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Optional[Callable[..., Any]]:
    """The broken KV owner filter ``plant`` gives this prefill rank (None: it keeps the right one)."""
    if plant is None:
        return None
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    right = utils.filter_kv_indices_for_shared_kv
    if plant == "wrong_owner":
        # Pages of the next rank's lane, read from this rank's slots of the same ids.
        def wrong(layout, kv_indices, index_slice):
            shifted = CpSharedKVLayout(layout.cp_size, (layout.cp_rank + 1) % layout.cp_size, layout.page_size)
            return right(shifted, kv_indices, index_slice)

        return wrong
    if cp_rank == cp_size - 1:  # rank_skips_send: the last rank sends no pages

        def skip(layout, kv_indices, index_slice):
            src, dst = right(layout, kv_indices, index_slice)
            return src[:0], dst[:0]

        return skip
    return None


def plant_bug(plant: Optional[str], cp_rank: int, cp_size: int) -> None:
    """Break this prefill rank's KV owner filter as ``plant`` says, for good (the simulator's fault)."""
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    wrong = _wrong_filter(plant, cp_rank, cp_size)
    if wrong is not None:
        utils.filter_kv_indices_for_shared_kv = wrong


@contextlib.contextmanager
def planted_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Iterator[None]:
    """Within the block, this prefill rank's KV owner filter is broken as ``plant`` says;
    restored after (the block ends once the request's transfer polled Success or Failed)."""
    from sglang_cp_hicache.v0_5_12.disaggregation import utils

    right, wrong = utils.filter_kv_indices_for_shared_kv, _wrong_filter(plant, cp_rank, cp_size)
    if wrong is None:
        yield
        return
    utils.filter_kv_indices_for_shared_kv = wrong
    try:
        yield
    finally:
        utils.filter_kv_indices_for_shared_kv = right


# ------------------------------------------------------------------ pools
def pool_buffers(pools: List[Any]) -> List[torch.Tensor]:
    """Every device buffer a PD transfer touches: per layer, MLA KV and NSA indexer K/scale."""
    buffers = []
    for pool in pools:
        if pool is None:
            continue
        buffers += list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer)
    return buffers


def host_buffers(cache: Any) -> List[torch.Tensor]:
    """The host tier's bytes: every host pool of the CP host group (MLA KV, NSA indexer),
    and of its MTP draft group."""
    groups = [cache.token_to_kv_pool_host, getattr(cache.token_to_kv_pool_host, "draft", None)]
    buffers = []
    for group in (g for g in groups if g is not None):
        for entry in group.entries:
            for name in ("kv_buffer", "index_k_with_scale_buffer"):
                if hasattr(entry.host_pool, name):
                    buffers.append(getattr(entry.host_pool, name))
    return buffers


def page_rows(buffer: torch.Tensor, num_pages: int) -> torch.Tensor:
    """A paged pool buffer as uint8 rows, one per page (the KV buffer holds a page's
    tokens in consecutive rows, the NSA indexer buffer one row per page)."""
    raw = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
    return raw.reshape(num_pages, -1)


__all__ = [
    "HIDDEN_SIZE",
    "host_buffers",
    "page_rows",
    "PAGE_SIZE",
    "PDScenario",
    "plant_bug",
    "planted_filter",
    "pool_buffers",
]
