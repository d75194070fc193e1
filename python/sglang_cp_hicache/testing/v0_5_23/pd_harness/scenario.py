"""What every role of one 0.5.23 PD cluster runs (:class:`PDScenario`), the byte pattern a
prefill rank stores and the decode checks (:class:`KVPattern`, :data:`HARNESS_PATTERN`), the
MTP draft's sharded pool, and the negative controls planted in upstream's owner filter."""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.pd.scenario import EvictDevice, PDRequest, ScenarioSteps, Step


PAGE_SIZE = 64  # DSA's indexer pages
INDEX_KEY_BYTES = 128  # fp8 indexer key per token
INDEX_SCALE_BYTES = 4  # fp32 scale per token
HIDDEN_SIZE = 64  # the metadata buffers' hidden state
DRAFT_LAYERS = 1  # one NextN layer (what upstream's sharded MTP admits)
#: Where upstream's owner filter is bound by name (KV pages; DSA indexer pages).
_FILTER_MODULES = ("sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.mooncake.conn")


# ------------------------------------------------------------------ scenario
@dataclass(frozen=True)
class PDScenario(ScenarioSteps):
    """What every role of one 0.5.23 cluster runs.

    ``plants`` (negative controls) maps a request id to a bug planted in upstream's owner
    filter on the prefill ranks while that request is served: ``wrong_owner`` makes each
    rank pick the next rank's lane (its local ids, read from its own rows);
    ``rank_skips_send`` makes the last rank send no pages (it still reports). The decode
    re-checks a planted request at the end apart from the others
    (``final_planted_kv_mismatches``).
    ``pause_after_chunk`` names a request whose prefill ranks stop after their first chunk
    until the harness answers the ``chunk-sent`` checkpoint (the decode-killed fault).
    ``hold_after_registering``: the prefill ranks wait for the harness's ``go`` once
    registered (the fault cluster's decodes start meanwhile).
    ``draft``: the MTP draft's one-layer sharded pool beside the target on every prefill
    rank (upstream's ``num_draft_entries``), and its KV checked on the decode. The draft is
    not in the stack's host tier (``build_sharded_stack`` has no PACKED draft host layers),
    so a draft scenario must not take a prefix from a host load-back.
    """

    cp_size: int
    steps: Tuple[Step, ...]
    draft: bool = False
    layer_num: int = 2
    prefill_pages_per_rank: int = 24
    decode_pages: int = 96
    plants: Tuple[Tuple[str, str], ...] = ()
    pause_after_chunk: Optional[str] = None
    hold_after_registering: bool = False
    transfer_timeout_s: float = 60.0
    seed: int = 0
    context_len: int = 2048  # the longest prompt a rank's and the decode's request rows hold

    def __post_init__(self) -> None:
        self.check_plants()
        if self.cp_size < 2:
            raise ValueError("the 0.5.23 PD harness shards KV: cp_size must be >= 2")
        if self.draft and any(isinstance(step, EvictDevice) for step in self.steps):
            raise ValueError("a draft scenario cannot load back from host: the draft has no host layers")

    def stack_config(self) -> Any:
        """One prefill rank's ``StackConfig`` (the plugin's flag on)."""
        from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

        return StackConfig(
            page_size=PAGE_SIZE,
            layer_num=self.layer_num,
            device_pages_per_rank=self.prefill_pages_per_rank,
            context_len=self.context_len,
            chunk_tokens=1024,
            max_num_reqs=8,
            max_prefix_tokens=2048,
            cp_shared_kv=True,
        )


# ------------------------------------------------------------------ the byte pattern
def kv_pattern(token_ids: torch.Tensor, positions: torch.Tensor, layer: int, dim: int) -> torch.Tensor:
    """The MLA KV row ``[n, 1, dim]`` a forward stores for each (token, position) on
    ``layer`` (bf16-exact small integers)."""
    base = (token_ids * 7 + positions * 13 + layer * 31)[:, None] + torch.arange(dim)[None]
    return ((base % 251) - 125).to(torch.bfloat16).unsqueeze(1)


def index_pattern(token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
    """Each token's DSA indexer bytes ``[n, 132]`` on ``layer``: fp8 key then fp32 scale."""
    width = INDEX_KEY_BYTES + INDEX_SCALE_BYTES
    base = (token_ids * 5 + positions * 11 + layer * 17)[:, None] + torch.arange(width)[None] * 3
    return (base % 256).to(torch.uint8)


@dataclass(frozen=True)
class KVPattern:
    """What a forward stores per token, the reference every decode-side check reads:
    ``kv(token_ids, positions, layer, dim)`` -> MLA KV rows ``[n, 1, dim]`` (bf16);
    ``index(token_ids, positions, layer)`` -> DSA indexer bytes ``[n, 132]`` (uint8, key
    then scale); the draft's layers are ``draft_first_layer + i``."""

    kv: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    index: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    draft_first_layer: int = 100


#: The harness's own pattern (what :func:`write_owned_kv` stores by default).
HARNESS_PATTERN = KVPattern(kv=kv_pattern, index=index_pattern)


def _index_offsets(locs: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(page row, byte offsets [n, 132]) of each token slot in the packed indexer page
    (``page_size`` keys of 128 B, then ``page_size`` scales of 4 B)."""
    page, slot = locs // page_size, locs % page_size
    keys = slot[:, None] * INDEX_KEY_BYTES + torch.arange(INDEX_KEY_BYTES)[None]
    scales = page_size * INDEX_KEY_BYTES + slot[:, None] * INDEX_SCALE_BYTES + torch.arange(INDEX_SCALE_BYTES)[None]
    return page, torch.cat([keys, scales], dim=1)


def store_tokens(
    pool: Any,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    first_layer: int = 0,
) -> None:
    """A forward's stores of :data:`HARNESS_PATTERN` into ``pool``'s own (physical) ``rows``:
    KV and indexer, every layer (``first_layer``: the pattern's layer of the pool's layer 0)."""
    if len(rows) == 0:
        return
    dim = pool.kv_buffer[0].shape[-1]
    page, offsets = _index_offsets(rows, pool.page_size)
    for layer in range(pool.layer_num):
        pool.kv_buffer[layer][rows] = HARNESS_PATTERN.kv(token_ids, positions, first_layer + layer, dim)
        index = HARNESS_PATTERN.index(token_ids, positions, first_layer + layer)
        pool.index_k_with_scale_buffer[layer][page[:, None], offsets] = index


def count_kv_mismatches(
    pool: Any,
    rows: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    first_layer: int = 0,
    pattern: KVPattern = HARNESS_PATTERN,
) -> int:
    """Tokens whose KV row or indexer bytes in ``pool`` at ``rows`` differ from the pattern."""
    if len(rows) == 0:
        return 0
    dim = pool.kv_buffer[0].shape[-1]
    page, offsets = _index_offsets(rows, pool.page_size)
    bad = torch.zeros(len(rows), dtype=torch.bool)
    for layer in range(pool.layer_num):
        kv = pool.kv_buffer[layer][rows]
        expected = pattern.kv(token_ids, positions, first_layer + layer, dim)
        bad |= (kv.view(torch.uint8) != expected.view(torch.uint8)).flatten(1).any(1)
        index = pool.index_k_with_scale_buffer[layer][page[:, None], offsets]
        bad |= (index != pattern.index(token_ids, positions, first_layer + layer)).any(1)
    return int(bad.sum())


def write_owned_kv(
    stack: Any, logical_locs: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, draft_pool: Any = None
) -> None:
    """What a sharded forward stores: the tokens whose logical slot this rank owns, at their
    physical rows (``stack`` a :class:`~sglang_cp_hicache.testing.v0_5_23.rank_stack.RankStack`),
    in the target pool and, given, the MTP draft's (same logical slots, same owners)."""
    owned = stack.owned_mask(logical_locs)
    rows, ids, pos = stack.physical_rows(logical_locs), token_ids[owned], positions[owned]
    store_tokens(stack.kv_pool, rows, ids, pos)
    if draft_pool is not None:
        store_tokens(draft_pool, rows, ids, pos, first_layer=HARNESS_PATTERN.draft_first_layer)


def build_draft_pool(stack: Any) -> Any:
    """The MTP draft's sharded pool beside ``stack``'s target, as upstream builds it
    (``KVCacheConfigurator._build_mtp_kv_shard_pool``): one layer, the target's shard spec,
    shard group and geometry, its own latent and indexer buffers; it shares the target's
    logical allocator (so its owners)."""
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    target, cfg = stack.kv_pool, stack.config
    return PageInterleaveDSATokenToKVPool(
        size=target.size, page_size=target.page_size, dtype=cfg.dtype, layer_num=DRAFT_LAYERS,
        device="cpu", enable_memory_saver=False, shard_spec=target.shard_spec,
        shard_group=target.shard_group, kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim, kv_cache_dim=target.kv_cache_dim,
        index_head_dim=cfg.index_head_dim, index_kpool=1,
    )  # fmt: skip


def expected_hidden_state(spec: PDRequest) -> torch.Tensor:
    """The MTP hidden state prefill carries for ``spec`` (bf16-exact small integers)."""
    return ((torch.arange(HIDDEN_SIZE) + spec.next_token) % 97 - 48).to(torch.bfloat16)


def pool_buffers(pool: Any) -> List[torch.Tensor]:
    return list(pool.kv_buffer) + list(pool.index_k_with_scale_buffer)


def as_bytes(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer


# ------------------------------------------------------------------ negative controls
@contextlib.contextmanager
def planted_filter(plant: Optional[str], cp_rank: int, cp_size: int) -> Iterator[None]:
    """Within the block, upstream's owner filter on this prefill rank is broken as ``plant``
    says (both names it is bound by: KV pages and DSA indexer pages); restored after."""
    modules = [importlib.import_module(name) for name in _FILTER_MODULES]
    right = modules[0].filter_kv_indices_for_shard_rank
    wrong = None
    if plant == "wrong_owner":

        def wrong(*, kv_indices, index_slice, shard_rank, shard_size):
            next_rank = (shard_rank + 1) % shard_size
            return right(kv_indices=kv_indices, index_slice=index_slice, shard_rank=next_rank, shard_size=shard_size)

    elif plant == "rank_skips_send" and cp_rank == cp_size - 1:

        def wrong(*, kv_indices, index_slice, shard_rank, shard_size):
            local, positions = right(
                kv_indices=kv_indices, index_slice=index_slice, shard_rank=shard_rank, shard_size=shard_size
            )
            return local[:0], positions[:0]

    if wrong is None:
        yield
        return
    for module in modules:
        module.filter_kv_indices_for_shard_rank = wrong
    try:
        yield
    finally:
        for module in modules:
            module.filter_kv_indices_for_shard_rank = right


__all__ = [
    "as_bytes",
    "build_draft_pool",
    "count_kv_mismatches",
    "DRAFT_LAYERS",
    "expected_hidden_state",
    "HARNESS_PATTERN",
    "HIDDEN_SIZE",
    "INDEX_KEY_BYTES",
    "index_pattern",
    "INDEX_SCALE_BYTES",
    "kv_pattern",
    "KVPattern",
    "PAGE_SIZE",
    "PDScenario",
    "planted_filter",
    "pool_buffers",
    "store_tokens",
    "write_owned_kv",
]
