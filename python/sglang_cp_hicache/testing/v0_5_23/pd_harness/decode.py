"""The 0.5.23 PD decode server (:class:`DecodeServer`): a full unsharded pool under
upstream's decode queues, every byte that lands checked against the pattern; its role body."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang_cp_hicache.testing.pd.engine import ErrorLog, init_transfer_engine
from sglang_cp_hicache.testing.pd.roles import LOOPBACK, PDPorts, RoleChannel
from sglang_cp_hicache.testing.pd.scenario import DecodeReport, PDRequest, SENTINEL_BYTE
from sglang_cp_hicache.testing.pd.steps import DecodeChecks, load_plugins
from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import (
    DecodeSchedulerFields,
    dsa_model_config,
    publish_pd_record,
    stamp_parallel,
)
from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import (
    DRAFT_LAYERS,
    HARNESS_PATTERN,
    HIDDEN_SIZE,
    KVPattern,
    PAGE_SIZE,
    PDScenario,
    as_bytes,
    pool_buffers,
    count_kv_mismatches,
    expected_hidden_state,
)


# ------------------------------------------------------------------ decode
class DecodeServer(DecodeChecks):
    """The decode server: a full (cp 1) ``DSATokenToKVPool`` under upstream's PD decode queues."""

    page_size = PAGE_SIZE

    def __init__(self, scenario: PDScenario, ports: PDPorts, pattern: KVPattern = HARNESS_PATTERN):
        """``scenario`` gives the geometry (``layer_num``, ``decode_pages``, ``draft``);
        ``pattern`` is what the prefill side stored (the check's reference)."""
        self.scenario, self.ports, self.pattern = scenario, ports, pattern
        self.server_args = publish_pd_record("decode", ports.bootstrap)
        from sglang_cp_hicache.testing.dist import single_rank_world

        world = single_rank_world()
        stamp_parallel(1, 0, world, world)
        self.kv_pool, self.draft_pool, self.allocator, self.req_to_token_pool, self.tree_cache = self._build_stack()
        self._scatter_free_pages(np.random.default_rng(scenario.seed))
        for buffer in self._buffers():
            as_bytes(buffer).fill_(SENTINEL_BYTE)
        self.errors = ErrorLog()
        init_transfer_engine()
        self.prealloc_queue, self.transfer_queue = self._build_queues()
        self.granted: set = set()
        self.served: List[Tuple[PDRequest, torch.Tensor]] = []
        self.planted: List[Tuple[PDRequest, torch.Tensor]] = []

    def _buffers(self) -> List[torch.Tensor]:
        pools = [self.kv_pool] + ([self.draft_pool] if self.draft_pool is not None else [])
        return [b for pool in pools for b in pool_buffers(pool)]

    def _build_stack(self) -> Tuple[Any, Any, Any, Any, Any]:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        cfg = self.scenario.stack_config()
        size = PAGE_SIZE * self.scenario.decode_pages
        def pool(layer_num: int) -> Any:
            return DSATokenToKVPool(
                size, page_size=PAGE_SIZE, kv_lora_rank=cfg.kv_lora_rank, dtype=cfg.dtype,
                qk_rope_head_dim=cfg.qk_rope_head_dim, layer_num=layer_num, device="cpu",
                index_head_dim=cfg.index_head_dim, enable_memory_saver=False, kv_cache_dim=cfg.kv_cache_dim,
            )  # fmt: skip

        kv_pool = pool(cfg.layer_num)
        draft_pool = pool(DRAFT_LAYERS) if self.scenario.draft else None
        allocator = PagedTokenToKVPoolAllocator(
            size, page_size=PAGE_SIZE, dtype=cfg.dtype, device="cpu", kvcache=kv_pool, need_sort=False
        )
        req_to_token_pool = ReqToTokenPool(
            size=32, max_context_len=cfg.context_len, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            disable=True, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
            page_size=PAGE_SIZE, tree_components=(ComponentType.FULL,),
        )  # fmt: skip
        return kv_pool, draft_pool, allocator, req_to_token_pool, UnifiedRadixCache(params=params)

    def _build_queues(self) -> Tuple[Any, Any]:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.fields = DecodeSchedulerFields(
            server_args=self.server_args,
            model_config=dsa_model_config(self.scenario.layer_num),
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if self.scenario.draft else None),
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False, model_runner=SimpleNamespace(kv_cache_dtype_str="bfloat16")
            ),
        )
        self.metadata_buffers = MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16, 0)
        metadata_allocator = ReqToMetadataIdxAllocator(8)
        transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=metadata_allocator, metadata_buffers=self.metadata_buffers,
            scheduler=self.fields, tree_cache=self.tree_cache,
        )  # fmt: skip
        prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=self.draft_pool, req_to_metadata_buffer_idx_allocator=metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.fields, transfer_queue=transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0, bootstrap_port=self.ports.bootstrap,
            max_total_num_tokens=self.allocator.size, num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.MOONCAKE,
        )  # fmt: skip
        self.fields.disagg_decode_prealloc_queue = prealloc_queue
        # Upstream tries an unreachable bootstrap 15 times, 1 s apart; 3 keep the fault short.
        prealloc_queue._max_ensure_retries = 3
        return prealloc_queue, transfer_queue

    def _scatter_free_pages(self, rng: np.random.Generator) -> None:
        """A decode server that has served before: its free pages in no particular order."""
        order = torch.from_numpy(rng.permutation(len(self.allocator.free_pages)))
        self.allocator.free_pages = self.allocator.free_pages[order]

    def _changed_pages(self) -> np.ndarray:
        """Per page, whether any pool byte differs from the sentinel."""
        num_pages = self.scenario.decode_pages + 1  # page 0 is the pool's padding page
        changed = torch.zeros(num_pages, dtype=torch.bool)
        for buffer in self._buffers():
            changed |= (as_bytes(buffer).reshape(num_pages, -1) != SENTINEL_BYTE).any(dim=1)
        return changed.numpy()

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the decode server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=array("q", spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host=LOOPBACK,
            bootstrap_port=spec.bootstrap_port or self.ports.bootstrap, bootstrap_room=spec.room,
        )  # fmt: skip

    def _locs(self, req: Any, n: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]

    def _aux_ok(self, spec: PDRequest, req: Any) -> bool:
        return list(req.output_ids) == [spec.next_token] and (
            self.draft_pool is None or torch.equal(req.hidden_states_tensor, expected_hidden_state(spec))
        )

    def _release(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree_cache, checkpoint=False)

    def _keep(self, spec: PDRequest, locs: torch.Tensor, req: Any) -> None:
        """Decoding ends here: the row goes back; the pages stay held, so the final
        re-check sees whether a later transfer wrote into them (planted requests are
        re-checked apart)."""
        kept = self.served if self.scenario.plant_for(spec.rid) is None else self.planted
        kept.append((spec, locs))
        self.req_to_token_pool.free(req)

    def _mismatches(self, spec: PDRequest, locs: torch.Tensor) -> Tuple[int, int]:
        """(target, draft) tokens whose bytes differ from the pattern at decode's ``locs``."""
        ids, pos = torch.tensor(spec.token_ids), torch.arange(len(spec.token_ids))
        target = count_kv_mismatches(self.kv_pool, locs, ids, pos, pattern=self.pattern)
        if self.draft_pool is None:
            return target, 0
        first = self.pattern.draft_first_layer
        return target, count_kv_mismatches(self.draft_pool, locs, ids, pos, first_layer=first, pattern=self.pattern)

def decode_role(
    channel: RoleChannel, scenario: PDScenario, ports: PDPorts, rids: Optional[Sequence[str]] = None
) -> DecodeReport:
    """Role: the decode server; serves the scenario's requests (or only ``rids``)."""
    load_plugins()  # pip-installed beside SGLang on the decode server too (its flag is off)
    server = DecodeServer(scenario, ports)
    channel.event("ready")
    outcomes = [server.serve(spec) for spec in scenario.requests if rids is None or spec.rid in rids]
    return server.report(outcomes)


__all__ = [
    "decode_role",
    "DecodeServer",
]
