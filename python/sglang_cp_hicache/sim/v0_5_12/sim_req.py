"""The 0.5.12.post1 driver's request record: :class:`SimReq`, the fields of SGLang's ``Req``
that the cache path reads and writes, one per attempt (a retraction re-queues a fresh one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from sglang_cp_hicache.sim.engine import TraceAttempt


@dataclass(eq=False)
class SimReq(TraceAttempt):
    """The fields of SGLang's ``Req`` that the cache path reads and writes.

    Prefill only: the request finishes after its (last chunk's) forward, with its prompt as
    committed KV (no output tokens).
    """

    fill_len: int = 0  # prompt tokens scheduled so far (chunked prefill: grows per chunk)
    req_pool_idx: Optional[int] = None
    is_chunked: int = 0
    kv_committed_len: int = 0
    kv_committed_freed: bool = False
    extra_key: Optional[str] = None
    priority: int = 0
    prefix_indices: Optional[torch.Tensor] = None
    last_node: Any = None
    best_match_node: Any = None
    host_hit_length: int = 0
    cache_protected_len: int = 0
    device_hit: int = 0
    loaded: int = 0

    @property
    def token_ids(self) -> Sequence[int]:
        """The tokens scheduled so far (the whole prompt without chunking)."""
        return self.request.token_ids[: self.fill_len]

    @property
    def fill_ids(self) -> List[int]:
        return list(self.token_ids)

    @property
    def finished_prefill(self) -> bool:
        return self.fill_len == len(self.prompt)

    @property
    def origin_input_ids(self) -> List[int]:
        return list(self.token_ids)

    @property
    def output_ids(self) -> List[int]:
        return []

    def pop_committed_kv_cache(self) -> int:
        assert not self.kv_committed_freed, "committed KV freed twice"
        self.kv_committed_freed = True
        return self.kv_committed_len


__all__ = ["SimReq"]
