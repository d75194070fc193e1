"""Torch reference of NSA sparse MLA prefill, shaped like SGLang's components.

indexer scores (ReLU(q_idx . k_idx), head-gated) -> causal top-k -> absorbed MLA attention
over the selected latent KV rows. The pieces carry the attribute and method names the
shared-KV hooks touch on SGLang's real classes, so the hooks wrap them unchanged:

* :class:`ReferenceNSAPool` ~ ``NSATokenToKVPool`` (``kv_buffer`` token rows with a padding
  page, page-packed ``index_k_with_scale_buffer`` in SGLang's layout: a page's fp8 K block,
  then its fp32 scales; ``set_mla_kv_buffer``, ``set_index_k_scale_buffer``, getters);
* :class:`ReferenceNSABackend` ~ ``NativeSparseAttnBackend`` (``init_forward_metadata`` from
  the logical ``req_to_token``; ``forward_extend`` stores, then reads ``get_key_buffer``
  through ``metadata.page_table_1``);
* :class:`ReferenceIndexer` ~ ``Indexer`` (``forward_cuda`` stores, then reads index K with
  the pool's ``get_index_k_continuous`` / ``get_index_k_scale_continuous`` through
  ``metadata.real_page_table``; ``_store_index_k_cache``).

With SGLang's real ``NSATokenToKVPool`` on a GPU in place of the reference pool, the KV and
index-K writes and the index-K reads run SGLang's own Triton kernels.

Inputs are random (seeded); nothing here loads model weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4


@dataclass(frozen=True)
class SparseMLAConfig:
    num_layers: int = 2
    hidden_size: int = 32
    num_heads: int = 4
    kv_lora_rank: int = 16
    qk_rope_head_dim: int = 8
    index_n_heads: int = 2
    index_head_dim: int = 16
    index_topk: int = 12
    page_size: int = 4
    kv_dtype: torch.dtype = torch.float32

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


TINY_CONFIG = SparseMLAConfig()


@dataclass(frozen=True)
class LayerWeights:
    w_kv: torch.Tensor  # [hidden, kv_lora_rank]
    w_k_rope: torch.Tensor  # [hidden, rope]
    w_q_nope: torch.Tensor  # [hidden, heads, kv_lora_rank] (absorbed)
    w_q_rope: torch.Tensor  # [hidden, heads, rope]
    w_index_k: torch.Tensor  # [hidden, index_head_dim]
    w_index_q: torch.Tensor  # [hidden, index_heads, index_head_dim]
    w_index_gate: torch.Tensor  # [hidden, index_heads]
    w_out: torch.Tensor  # [heads * kv_lora_rank, hidden]


def random_weights(config: SparseMLAConfig, seed: int, device) -> List[LayerWeights]:
    gen = torch.Generator().manual_seed(seed)
    c = config

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device)

    return [
        LayerWeights(
            w_kv=rand(c.hidden_size, c.kv_lora_rank),
            w_k_rope=rand(c.hidden_size, c.qk_rope_head_dim),
            w_q_nope=rand(c.hidden_size, c.num_heads, c.kv_lora_rank),
            w_q_rope=rand(c.hidden_size, c.num_heads, c.qk_rope_head_dim),
            w_index_k=rand(c.hidden_size, c.index_head_dim),
            w_index_q=rand(c.hidden_size, c.index_n_heads, c.index_head_dim),
            w_index_gate=rand(c.hidden_size, c.index_n_heads),
            w_out=rand(c.num_heads * c.kv_lora_rank, c.hidden_size),
        )
        for _ in range(c.num_layers)
    ]


# ------------------------------------------------------------------ index K layout
def quantize_index_k(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 e4m3 K and fp32 scale ``[N, 1]`` (SGLang's indexer cache format)."""
    scale = (key.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (key.float() / scale).to(FP8), scale


def write_index_k(
    buf: torch.Tensor, locs: torch.Tensor, index_k: torch.Tensor, scale: torch.Tensor, page_size: int
) -> None:
    """Store fp8 K + fp32 scale of each token at ``locs`` in a page-packed uint8 buffer."""
    head_dim = index_k.shape[1]
    locs = locs.to(torch.int64)
    pages, offsets = locs // page_size, locs % page_size
    k_cols = offsets[:, None] * head_dim + torch.arange(head_dim, device=buf.device)
    buf[pages[:, None], k_cols] = index_k.contiguous().view(torch.uint8)
    s_cols = page_size * head_dim + offsets[:, None] * SCALE_BYTES + torch.arange(SCALE_BYTES, device=buf.device)
    buf[pages[:, None], s_cols] = scale.to(torch.float32).contiguous().view(torch.uint8).view(-1, SCALE_BYTES)


def read_index_k_bytes(buf: torch.Tensor, pages: torch.Tensor, seq_len: int, page_size: int, head_dim: int):
    """fp8 K bytes ``[seq_len, head_dim]`` and scale bytes ``[seq_len, 4]`` of a sequence
    stored in ``pages`` (what SGLang's ``GetK`` / ``GetS`` return)."""
    rows = buf[pages.to(torch.int64)]
    k = rows[:, : page_size * head_dim].reshape(-1, head_dim)[:seq_len]
    scales = rows[:, page_size * head_dim :].reshape(-1, SCALE_BYTES)[:seq_len]
    return k, scales


def dequantize_index_k(k_bytes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    return k_bytes.contiguous().view(FP8).float() * scale_bytes.contiguous().view(torch.float32)


# ---------------------------------------------------------------- kernel references
def flash_mla_sparse_fwd_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    **_: Any,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch ``flash_mla_sparse_fwd``: query ``s`` attends, over every head, to the KV rows
    ``indices[s, 0, :topk_length[s]]`` that are not -1 (the reference sparse MLA's
    absorbed attention: scores over all ``d_qk``, values the first ``d_v``). A query with
    no valid row outputs zeros. Returns ``(out, max_logits, lse)``."""
    if attn_sink is not None:
        raise NotImplementedError("flash_mla_sparse_fwd stand-in: no attention sinks")
    selected = indices[:, 0, :].long()
    valid = selected >= 0
    if topk_length is not None:
        valid &= torch.arange(selected.shape[1])[None, :] < topk_length[:, None]
    rows = kv[selected.clamp(min=0), 0].float()  # [s_q, topk, d_qk]
    logits = torch.einsum("shd,std->sht", q.float(), rows) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    out = torch.einsum("sht,std->shd", probs, rows[..., :d_v]).to(q.dtype)
    return out, logits.amax(dim=-1), lse


def set_mla_kv_buffer_reference(kv_buffer: Any, loc: Any, cache_k_nope: Any, cache_k_rope: Any) -> None:
    """``set_mla_kv_buffer_triton``: row ``loc`` of ``kv_buffer`` gets the nope values, then
    the rope values, as the buffer's dtype reads their bytes."""
    rows = kv_buffer.view(kv_buffer.shape[0], -1)
    nope = cache_k_nope.reshape(loc.numel(), -1)
    rope = cache_k_rope.reshape(loc.numel(), -1)
    as_rows = lambda part: part if part.dtype == rows.dtype else part.view(rows.dtype)  # noqa: E731
    rows[loc.long(), : nope.shape[1]] = as_rows(nope)
    rows[loc.long(), nope.shape[1] : nope.shape[1] + rope.shape[1]] = as_rows(rope)


def get_mla_kv_buffer_reference(
    kv_buffer: torch.Tensor,
    loc: torch.Tensor,
    cache_k_nope: torch.Tensor,
    cache_k_rope: Optional[torch.Tensor] = None,
) -> None:
    """Torch ``get_mla_kv_buffer_triton``: row ``loc`` of ``kv_buffer`` split into its
    first ``nope_dim`` values and the next ``rope_dim``, converted to the outputs' dtype."""
    n = loc.numel()
    rows = kv_buffer.reshape(kv_buffer.shape[0], -1)[loc.long()]
    nope_dim = cache_k_nope.shape[-1]
    # view(): the outputs must be written in place, never through a copy.
    cache_k_nope.view(n, -1)[:, :nope_dim] = rows[:, :nope_dim]
    if cache_k_rope is not None and cache_k_rope.numel() > 0:
        rope_dim = cache_k_rope.shape[-1]
        cache_k_rope.view(n, -1)[:, :rope_dim] = rows[:, nope_dim : nope_dim + rope_dim]


def interleave_split(extend_lens: List[int], cp_size: int, cp_rank: int) -> Tuple[List[int], List[int]]:
    """CP rank ``cp_rank``'s share of each request's extend when the batch's tokens are dealt
    round robin over ``cp_size`` ranks (the remainder carried to the next request): its
    non-zero shares and the requests they belong to (SGLang's interleave / round-robin CP
    split, both lines)."""
    lens, rows, carried = [], [], 0
    for row, extend_len in enumerate(extend_lens):
        tokens = extend_len + carried
        share = tokens // cp_size + int(tokens % cp_size > cp_rank)
        if share:
            lens.append(share)
            rows.append(row)
        carried = tokens - share * cp_size
    return lens, rows


# ------------------------------------------------------------------------- pool
class ReferenceNSAPool:
    """One rank's device pool: ``size`` tokens plus the padding page 0."""

    def __init__(self, config: SparseMLAConfig, size: int, device):
        self.size = size
        self.page_size = config.page_size
        self.index_head_dim = config.index_head_dim
        self.start_layer = 0
        self.layer_num = config.num_layers
        self.dtype = config.kv_dtype
        self.layer_transfer_counter = None
        num_pages = size // config.page_size + 1
        self.kv_buffer = [
            torch.zeros(num_pages * config.page_size, 1, config.kv_cache_dim, dtype=config.kv_dtype, device=device)
            for _ in range(config.num_layers)
        ]
        self.index_k_with_scale_buffer = [
            torch.zeros(num_pages, config.page_size * (config.index_head_dim + SCALE_BYTES), dtype=torch.uint8, device=device)
            for _ in range(config.num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id - self.start_layer]

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_with_scale_buffer[layer_id - self.start_layer]

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope) -> None:
        rows = torch.cat([cache_k_nope, cache_k_rope], dim=-1).to(self.dtype)
        self.kv_buffer[layer.layer_id - self.start_layer][loc.to(torch.int64)] = rows

    def set_index_k_scale_buffer(self, layer_id, loc, index_k, index_k_scale) -> None:
        buf = self.index_k_with_scale_buffer[layer_id - self.start_layer]
        write_index_k(buf, loc, index_k, index_k_scale, self.page_size)

    def get_index_k_continuous(self, layer_id, seq_len, page_indices) -> torch.Tensor:
        buf = self.index_k_with_scale_buffer[layer_id - self.start_layer]
        return read_index_k_bytes(buf, page_indices, seq_len, self.page_size, self.index_head_dim)[0]

    def get_index_k_scale_continuous(self, layer_id, seq_len, page_indices) -> torch.Tensor:
        buf = self.index_k_with_scale_buffer[layer_id - self.start_layer]
        return read_index_k_bytes(buf, page_indices, seq_len, self.page_size, self.index_head_dim)[1]


# ---------------------------------------------------------------- backend/indexer
@dataclass(frozen=True)
class ReferenceNSAMetadata:
    """The fields of SGLang's ``NSAMetadata`` the reference reads (same names)."""

    page_table_1: torch.Tensor  # [batch, max_seq_len] token locs
    real_page_table: torch.Tensor  # [batch, max_pages] page ids
    seq_lens: tuple  # per row
    page_table_1_flattened: Optional[torch.Tensor] = None


@dataclass
class QueryTokens:
    """The query tokens this rank computes (prefill CP split): batch row and position."""

    rows: torch.Tensor
    positions: torch.Tensor


class ReferenceNSABackend:
    def __init__(self, config: SparseMLAConfig):
        self.config = config
        self.real_page_size = config.page_size
        self.forward_metadata: Optional[ReferenceNSAMetadata] = None

    def init_forward_metadata(self, forward_batch) -> None:
        seq_lens = tuple(int(n) for n in forward_batch.seq_lens_cpu.tolist())
        page_table = forward_batch.req_to_token_pool.req_to_token[forward_batch.req_pool_indices, : max(seq_lens)]
        ps = self.real_page_size
        self.forward_metadata = ReferenceNSAMetadata(
            page_table_1=page_table,
            real_page_table=page_table[:, ::ps] // ps,
            seq_lens=seq_lens,
        )

    def forward_extend(
        self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None, topk_indices=None
    ) -> torch.Tensor:
        """``q``: ``[n, heads, r]``, ``q_rope``: ``[n, heads, rope]``, ``topk_indices``: ``[n, topk]``
        positions in the query's sequence (-1 = none). Returns ``[n, heads, r]``."""
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
        kv_cache = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)
        metadata = self.forward_metadata
        queries: QueryTokens = forward_batch.query_tokens
        r = self.config.kv_lora_rank
        scale = 1.0 / math.sqrt(r + self.config.qk_rope_head_dim)
        out = torch.zeros_like(q, dtype=torch.float32)
        for j in range(q.shape[0]):
            selected = topk_indices[j][topk_indices[j] >= 0]
            locs = metadata.page_table_1[queries.rows[j], selected]
            kv = kv_cache[locs.to(torch.int64), 0].float()
            logits = (q[j].float() @ kv[:, :r].T + q_rope[j].float() @ kv[:, r:].T) * scale
            out[j] = torch.softmax(logits, dim=-1) @ kv[:, :r]
        return out


class ReferenceIndexer:
    def __init__(self, config: SparseMLAConfig, weights: List[LayerWeights]):
        self.config = config
        self.weights = weights

    def forward_cuda(self, x, q_lora, positions, forward_batch, layer_id) -> torch.Tensor:
        """``x``: the gathered chunk's hidden states (keys); ``q_lora``: this rank's query
        hidden states; ``positions``: their :class:`QueryTokens`. Returns ``[n, topk]``."""
        c, w = self.config, self.weights[layer_id]
        self._store_index_k_cache(forward_batch, layer_id, x @ w.w_index_k)
        metadata = forward_batch.attn_backend.forward_metadata
        pool = forward_batch.token_to_kv_pool
        q_index = torch.einsum("nh,hid->nid", q_lora, w.w_index_q)
        gates = q_lora @ w.w_index_gate
        topk = torch.full((q_lora.shape[0], c.index_topk), -1, dtype=torch.int64, device=q_lora.device)
        for j in range(q_lora.shape[0]):
            row, pos = int(positions.rows[j]), int(positions.positions[j])
            seq_len = metadata.seq_lens[row]
            num_pages = -(-seq_len // c.page_size)
            pages = metadata.real_page_table[row, :num_pages]
            keys = dequantize_index_k(
                pool.get_index_k_continuous(layer_id, seq_len, pages),
                pool.get_index_k_scale_continuous(layer_id, seq_len, pages),
            )
            scores = (torch.relu(q_index[j] @ keys[: pos + 1].T) * gates[j][:, None]).sum(dim=0)
            chosen = torch.topk(scores, min(c.index_topk, pos + 1)).indices
            topk[j, : chosen.numel()] = chosen
        return topk

    def _store_index_k_cache(self, forward_batch, layer_id, key) -> None:
        index_k, scale = quantize_index_k(key)
        forward_batch.token_to_kv_pool.set_index_k_scale_buffer(layer_id, forward_batch.out_cache_loc, index_k, scale)


@dataclass
class LayerHandle:
    """What the pool's ``set_mla_kv_buffer`` reads from SGLang's ``RadixAttention``."""

    layer_id: int


class ReferenceSparseMLAModel:
    """Layer loop of one CP rank: queries for its own tokens, KV for the gathered chunk.

    ``gather_outputs(own_out) -> full_out`` stands for prefill CP's all-gather of the
    attention output back into token order.
    """

    def __init__(self, config: SparseMLAConfig, weights: List[LayerWeights], indexer, backend, gather_outputs):
        self.config = config
        self.weights = weights
        self.indexer = indexer
        self.backend = backend
        self.gather_outputs = gather_outputs

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        """``input_ids``: the chunk's hidden states ``[N, hidden]``; ``positions``: index of
        this rank's query tokens into the chunk. Returns the final hidden states."""
        hidden = input_ids
        queries: QueryTokens = forward_batch.query_tokens
        for layer_id, w in enumerate(self.weights):
            own = hidden[positions]
            topk = self.indexer.forward_cuda(hidden, own, queries, forward_batch, layer_id)
            latent = (hidden @ w.w_kv).unsqueeze(1).to(self.config.kv_dtype)
            k_rope = (hidden @ w.w_k_rope).unsqueeze(1).to(self.config.kv_dtype)
            q_nope = torch.einsum("nh,hgr->ngr", own, w.w_q_nope)
            q_rope = torch.einsum("nh,hgr->ngr", own, w.w_q_rope)
            attn = self.backend.forward_extend(
                q_nope, latent, latent, LayerHandle(layer_id), forward_batch,
                q_rope=q_rope, k_rope=k_rope, topk_indices=topk,
            )
            own_out = attn.reshape(attn.shape[0], -1) @ w.w_out
            hidden = hidden + self.gather_outputs(own_out)
        return hidden


def store_prefix(pool: Any, locs: torch.Tensor, prefix_kv: List[torch.Tensor], prefix_index_k: List[torch.Tensor], config: SparseMLAConfig) -> None:
    """Write an earlier forward's KV + index K of every layer at ``locs`` (any writer locs)."""
    r = config.kv_lora_rank
    for layer_id in range(config.num_layers):
        kv = prefix_kv[layer_id].to(config.kv_dtype)
        pool.set_mla_kv_buffer(LayerHandle(layer_id), locs, kv[:, None, :r], kv[:, None, r:])
        index_k, scale = quantize_index_k(prefix_index_k[layer_id])
        pool.set_index_k_scale_buffer(layer_id, locs, index_k, scale)
