"""The 0.5.12.post1 PD decode server (:class:`DecodeServer`): a full unsharded pool under
upstream's decode queues, every byte that lands checked against the pattern; its role body."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from sglang_cp_hicache.testing.pd.engine import ErrorLog, init_transfer_engine
from sglang_cp_hicache.testing.pd.roles import LOOPBACK, PDPorts, RoleChannel
from sglang_cp_hicache.testing.pd.scenario import DecodeReport, PDRequest, SENTINEL_BYTE
from sglang_cp_hicache.testing.pd.steps import DecodeChecks, load_plugins
from sglang_cp_hicache.testing.v0_5_12.pd_harness.context import (
    DecodeSchedulerFields,
    install_parallel_state,
    pd_server_args,
)
from sglang_cp_hicache.testing.v0_5_12.pd_harness.prefill import expected_hidden_state
from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import (
    HIDDEN_SIZE,
    PAGE_SIZE,
    PDScenario,
    page_rows,
    pool_buffers,
)


# ------------------------------------------------------------------ decode
class DecodeServer(DecodeChecks):
    """The decode server: a full (cp 1) NSA pool under upstream's PD decode queues."""

    page_size = PAGE_SIZE

    def __init__(self, scenario: PDScenario, ports: PDPorts):
        from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

        self.scenario, self.ports, self.ns = scenario, ports, nsa_stack
        self.stack = self._build_stack()
        self.pools = [p for p in (self.stack.kv_pool, self.stack.draft_pool) if p is not None]
        self._scatter_free_pages(np.random.default_rng(scenario.seed))
        self._fill_sentinel()
        self.server_args = pd_server_args("decode", 1, ports.bootstrap, scenario.draft)
        self.errors = ErrorLog()
        init_transfer_engine()
        self.prealloc_queue, self.transfer_queue = self._build_queues()
        self.granted: set = set()
        self.served: List[Tuple[PDRequest, Any]] = []
        self.planted: List[Tuple[PDRequest, Any]] = []

    def _build_stack(self) -> Any:
        """Pools, allocator and request slots of an unsharded decode (``nsa_stack``'s
        reference checks read it with layout None: every token)."""
        from sglang.srt.mem_cache import allocator as allocator_module
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch

        allocator_module.alloc_extend_kernel = NaiveExtendLaunch()  # Triton has no CPU backend
        cfg = self.ns.StackConfig(
            cp_size=1, layer_num=self.scenario.layer_num, page_size=PAGE_SIZE,
            physical_tokens=PAGE_SIZE * self.scenario.decode_pages,
        )  # fmt: skip
        kv_pool = self.ns.build_kv_pool(cfg)
        draft_pool = self.ns.build_kv_pool(cfg, layer_num=self.ns.DRAFT_LAYERS) if self.scenario.draft else None
        allocator = PagedTokenToKVPoolAllocator(cfg.physical_tokens, PAGE_SIZE, torch.bfloat16, "cpu", kv_pool, need_sort=False)
        req_to_token_pool = ReqToTokenPool(32, cfg.max_context_len, device="cpu", enable_memory_saver=False)
        return self.ns.RankStack(None, allocator, kv_pool, req_to_token_pool, None, draft_pool)

    def _build_queues(self) -> Tuple[Any, Any]:
        """Upstream's decode queues over this stack (their ``MooncakeKVManager`` inside)."""
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.chunk_cache import ChunkCache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_cp_hicache.testing.dist import single_rank_world

        stack, world = self.stack, single_rank_world()  # the decode's TP group: one rank
        fields = DecodeSchedulerFields(
            server_args=self.server_args,
            model_config=SimpleNamespace(num_hidden_layers=self.scenario.layer_num),
            # SGLang resolves NEXTN to EAGLE when it parses the server args.
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE" if self.scenario.draft else None),
        )
        self.metadata_buffers = MetadataBuffers(8, HIDDEN_SIZE, torch.bfloat16)
        metadata_allocator = ReqToMetadataIdxAllocator(8)
        self.tree_cache = tree_cache = ChunkCache(
            CacheInitParams(
                disable=True, req_to_token_pool=stack.req_to_token_pool,
                token_to_kv_pool_allocator=stack.allocator, page_size=PAGE_SIZE,
            )
        )  # fmt: skip
        transfer_queue = DecodeTransferQueue(
            gloo_group=world, req_to_metadata_buffer_idx_allocator=metadata_allocator, tp_rank=0,
            metadata_buffers=self.metadata_buffers, scheduler=fields, tree_cache=tree_cache,
        )  # fmt: skip
        prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=stack.req_to_token_pool, token_to_kv_pool_allocator=stack.allocator,
            draft_token_to_kv_pool=stack.draft_pool, req_to_metadata_buffer_idx_allocator=metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=fields, transfer_queue=transfer_queue,
            tree_cache=tree_cache, gloo_group=world, tp_rank=0, tp_size=1, dp_size=1, gpu_id=0,
            bootstrap_port=self.ports.bootstrap, max_total_num_tokens=stack.allocator.size, pp_rank=0,
            num_reserved_decode_tokens=0, transfer_backend=TransferBackend.MOONCAKE,
        )  # fmt: skip
        # Upstream tries an unreachable bootstrap 15 times, 1 s apart; 3 keep the fault short.
        prealloc_queue._max_ensure_retries = 3
        return prealloc_queue, transfer_queue

    def _scatter_free_pages(self, rng: np.random.Generator) -> None:
        """A decode server that has served before: its free pages in no particular order."""
        allocator = self.stack.allocator
        locs = allocator.alloc(allocator.available_size())
        for page in rng.permutation(len(locs) // PAGE_SIZE):
            allocator.free(locs[page * PAGE_SIZE : (page + 1) * PAGE_SIZE])

    def _fill_sentinel(self) -> None:
        for buffer in pool_buffers(self.pools):
            (buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer).fill_(SENTINEL_BYTE)

    def _changed_pages(self) -> np.ndarray:
        """Per page, whether any pool byte differs from the sentinel."""
        num_pages = self.scenario.decode_pages + 1  # page 0 is the pool's padding page
        changed = torch.zeros(num_pages, dtype=torch.bool)
        for buffer in pool_buffers(self.pools):
            changed |= (page_rows(buffer, num_pages) != SENTINEL_BYTE).any(dim=1)
        return changed.numpy()

    def _locs(self, req: Any, n: int) -> torch.Tensor:
        return self.stack.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    def _mismatches(self, spec: PDRequest, locs: torch.Tensor) -> Tuple[int, int]:
        ids, pos = torch.tensor(spec.token_ids), torch.arange(len(spec.token_ids))
        target = self.ns.count_kv_mismatches(self.stack, locs, ids, pos)
        draft = self.ns.count_draft_kv_mismatches(self.stack, locs, ids, pos) if self.scenario.draft else 0
        return target, draft

    def _new_req(self, spec: PDRequest) -> Any:
        """SGLang's ``Req`` of ``spec`` as the decode server receives it."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(
            rid=spec.rid, origin_input_text="", origin_input_ids=list(spec.token_ids),
            sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host=LOOPBACK,
            bootstrap_port=spec.bootstrap_port or self.ports.bootstrap, bootstrap_room=spec.room,
        )  # fmt: skip

    def _release(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree_cache, is_insert=False)

    def _keep(self, spec: PDRequest, locs: torch.Tensor, req: Any) -> None:
        kept = self.served if self.scenario.plant_for(spec.rid) is None else self.planted
        kept.append((spec, locs))

    def _aux_ok(self, spec: PDRequest, req: Any) -> bool:
        if req.output_ids != [spec.next_token]:
            return False
        if not self.scenario.draft:
            return True
        return torch.equal(req.hidden_states_tensor, expected_hidden_state(spec))

def decode_role(channel: RoleChannel, scenario: PDScenario, ports: PDPorts, rids: Optional[List[str]] = None) -> DecodeReport:
    """Role: the decode server; serves the scenario's requests (or only ``rids``)."""
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch

    load_plugins()  # pip-installed beside SGLang on the decode server too (its flag is off)
    install_parallel_state(1, 0)
    with scheduler_batch.cpu_scheduler_server_args(PAGE_SIZE):
        server = DecodeServer(scenario, ports)
        channel.event("ready")
        outcomes = []
        for spec in scenario.requests:
            if rids is None or spec.rid in rids:
                outcomes.append(server.serve(spec))
        return server.report(outcomes)


__all__ = [
    "decode_role",
    "DecodeServer",
]
