"""CPU stand-ins for what of the read path needs a GPU: the Triton/CUDA kernels (for fp8 the
store's quantizer and FlashMLA's sparse decode kernel), the NCCL gather behind the CP
gathers, the device capability."""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import ModuleType
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import (
    flash_mla_sparse_fwd_reference,
    interleave_split,
)
from sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference import (
    flash_mla_with_kvcache_reference,
    get_mla_metadata_reference,
    quantize_k_cache_separate_reference,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import HOPPER_CAPABILITY
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooGatherCommunicator


# --------------------------------------------------------------- GPU-kernel stand-ins
def get_k_and_s_reference(
    cls,
    pool: Any,
    buf: torch.Tensor,
    page_indices: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    seq_len_sum: int,
    max_seq_len: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``GetKAndS.triton`` (``kernels/ops/kvcache/dsa_index_k_cache.py``): row ``b``'s
    first ``seq_len[b]`` tokens from pages ``page_indices[b]``, keys then fp32 scales, all
    rows concatenated (uint8 ``[seq_len_sum, 128]`` and ``[seq_len_sum, 4]``)."""
    ps, head_dim = pool.index_page_size, pool.index_head_dim
    keys, scales = [], []
    for row, seq_len in enumerate(seq_len_tensor.tolist()):
        pages = buf[page_indices[row, : -(-seq_len // ps)].long()]
        keys.append(pages[:, : ps * head_dim].reshape(-1, head_dim)[:seq_len])
        scales.append(pages[:, ps * head_dim :].reshape(-1, 4)[:seq_len])
    k_out, s_out = torch.cat(keys), torch.cat(scales)
    if k_out.shape[0] != seq_len_sum:
        raise ValueError(f"GetKAndS (CPU stand-in): {k_out.shape[0]} rows, not {seq_len_sum}")
    return k_out, s_out


def transform_index_page_table_prefill_reference(
    page_table: torch.Tensor,
    topk_indices: torch.Tensor,
    extend_lens_cpu: List[int],
    page_size: int = 1,
    output_num_tokens: Optional[int] = None,
    page_table_is_expanded: bool = False,
    cu_seqlens_q: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Torch ``transform_index_page_table_prefill`` (``kernels/ops/attention/dsa/
    transform_index.py``): query ``q`` of request row ``i`` maps each selected position
    ``p >= 0`` to ``page_table[i, p]`` (``page_table[q, p]`` for an expanded table, one row
    per query: EAGLE's target verify and draft extend); -1 stays -1, and so do padded query
    rows."""
    if page_size != 1:
        raise NotImplementedError("transform stand-in: page_size 1 only")
    rows = output_num_tokens if output_num_tokens is not None else topk_indices.shape[0]
    result = torch.full((rows, topk_indices.shape[1]), -1, dtype=torch.int32)
    starts = (
        cu_seqlens_q.tolist()
        if cu_seqlens_q is not None
        else [0, *torch.tensor(extend_lens_cpu).cumsum(0).tolist()]
    )
    for i in range(len(starts) - 1):
        selected = topk_indices[starts[i] : starts[i + 1]].long()
        if page_table_is_expanded:
            table = page_table[starts[i] : starts[i + 1]].long()
        else:
            table = page_table[i].long().expand(selected.shape[0], -1)
        mapped = torch.gather(table, 1, selected.clamp(min=0)).to(torch.int32)
        result[starts[i] : starts[i + 1]] = torch.where(selected >= 0, mapped, -1)
    return result


def dsa_cp_interleave_q_seqs_reference(
    extend_seqs: torch.Tensor, num_rank_seqs: int, cp_size: int, cp_rank: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``dsa_cp_interleave_q_seqs`` (``kernels/ops/attention/dsa/cp_split.py``): this
    rank's share of each request's extend (tokens interleaved over the whole batch, the
    remainder carried to the next request) and the requests it has any of."""
    lens, batch_rows = interleave_split(extend_seqs.tolist(), cp_size, cp_rank)
    if len(lens) != num_rank_seqs:
        raise ValueError(f"cp split stand-in: {len(lens)} requests, expected {num_rank_seqs}")
    return (
        torch.tensor(lens, dtype=extend_seqs.dtype),
        torch.tensor(batch_rows, dtype=torch.int32),
    )


class CpuKernelStandIns:
    """Installs (``with``) the torch stand-ins of what needs a GPU, and removes them.

    * ``GetKAndS.triton``, ``transform_index_page_table_prefill`` (as ``dsa_backend``
      binds it), ``dsa_cp_interleave_q_seqs``: Triton kernels (no driver on CPU);
    * ``flash_mla_interface.flash_mla_sparse_fwd`` (bf16) and, for the packed fp8 format,
      ``flash_mla_with_kvcache`` and ``get_mla_metadata``: the module imports the CUDA-only
      ``flash_mla`` package, so where that fails a stand-in module takes its place;
    * ``memory_pool.quantize_k_cache_separate``: the packed fp8 store's quantizer (Triton);
    * ``layers/cp/interleave.attn_cp_all_gather_into_tensor``: the attention-CP
      ``GroupCoordinator``'s NCCL all-gather, here over the gloo CP group;
    * ``torch.cuda.get_device_capability`` (while a backend is built): an H200.

    The runtime already provides the rest (the indexer store ``SetKAndS``, the pool's
    gather communicator; :mod:`~sglang_cp_hicache.testing.v0_5_23.runtime`).
    """

    FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"

    def __init__(self, cp_group: Any):
        self._cp_gather = GlooGatherCommunicator(group=cp_group, device="cpu")
        self._stack = contextlib.ExitStack()

    def _set(self, target: Any, name: str, value: Any) -> None:
        original = getattr(target, name)
        setattr(target, name, value)
        self._stack.callback(setattr, target, name, original)

    FLASH_MLA_STAND_INS = {
        "flash_mla_sparse_fwd": flash_mla_sparse_fwd_reference,
        "flash_mla_with_kvcache": flash_mla_with_kvcache_reference,
        "get_mla_metadata": get_mla_metadata_reference,
    }

    def _install_flash_mla(self) -> None:
        try:
            module = importlib.import_module(self.FLASH_MLA_INTERFACE)
        except ImportError:  # no flash_mla wheel: a module holding only the stand-ins
            module = ModuleType(self.FLASH_MLA_INTERFACE)
            for name, stand_in in self.FLASH_MLA_STAND_INS.items():
                setattr(module, name, stand_in)
            sys.modules[self.FLASH_MLA_INTERFACE] = module
            self._stack.callback(sys.modules.pop, self.FLASH_MLA_INTERFACE, None)
            return
        for name, stand_in in self.FLASH_MLA_STAND_INS.items():
            self._set(module, name, stand_in)

    def __enter__(self) -> "CpuKernelStandIns":
        from sglang.kernels.ops.attention.dsa import cp_split
        from sglang.kernels.ops.kvcache import dsa_index_k_cache
        from sglang.srt.layers.attention import dsa_backend
        from sglang.srt.layers.cp import interleave
        from sglang.srt.mem_cache import memory_pool

        self._set(dsa_index_k_cache.GetKAndS, "triton", classmethod(get_k_and_s_reference))
        self._set(memory_pool, "quantize_k_cache_separate", quantize_k_cache_separate_reference)
        self._set(
            dsa_backend,
            "transform_index_page_table_prefill",
            transform_index_page_table_prefill_reference,
        )
        self._set(cp_split, "dsa_cp_interleave_q_seqs", dsa_cp_interleave_q_seqs_reference)
        self._set(interleave, "attn_cp_all_gather_into_tensor", self._cp_gather.all_gather)
        self._install_flash_mla()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @staticmethod
    @contextlib.contextmanager
    def hopper_capability() -> Iterator[None]:
        original = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda *args, **kwargs: HOPPER_CAPABILITY
        try:
            yield
        finally:
            torch.cuda.get_device_capability = original
