"""SGLang's own batch allocation (``alloc_for_extend`` / ``alloc_for_decode``) on the CPU runtime.

A real ``ScheduleBatch`` carries the fields those functions read (what
``prepare_for_extend`` / ``prepare_for_decode`` set); requests are duck-typed ``Req``s with
the fields the cache path reads. The functions are looked up on SGLang's module at call
time, so the plugin's hooks (when applied) run around them, as in a scheduler.

``write_cache_indices`` picks its Triton kernel unless the global server args name a
non-Triton attention backend: :func:`cpu_scheduler_server_args` installs ones that do.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator, List, Sequence

import torch


@contextlib.contextmanager
def cpu_scheduler_server_args(page_size: int) -> Iterator[Any]:
    """Global server args as a CPU scheduler would have them (``torch_native`` backend);
    the previous ones are restored on exit."""
    from sglang.srt import server_args as sglang_server_args

    previous = sglang_server_args._global_server_args
    args = sglang_server_args.ServerArgs(
        model_path="dummy", page_size=page_size, attention_backend="torch_native"
    )
    sglang_server_args.set_global_server_args_for_scheduler(args)
    try:
        yield args
    finally:
        sglang_server_args.set_global_server_args_for_scheduler(previous)


def _batch(stack: Any, reqs: Sequence[Any]):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return ScheduleBatch(
        reqs=list(reqs),
        req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator,
        tree_cache=stack.cache,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        device="cpu",
    )


def alloc_for_extend(stack: Any, reqs: Sequence[Any], seq_lens: Sequence[int]) -> torch.Tensor:
    """``alloc_for_extend`` of requests whose ``prefix_indices`` (and ``last_node``) are set,
    each extended to ``seq_lens``; returns ``out_cache_loc``."""
    from sglang.srt.mem_cache import common

    batch = _batch(stack, reqs)
    batch.prefix_lens = [len(req.prefix_indices) for req in reqs]
    batch.extend_lens = [seq - pre for seq, pre in zip(seq_lens, batch.prefix_lens)]
    batch.extend_num_tokens = sum(batch.extend_lens)
    batch.seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    out_cache_loc, _, _ = common.alloc_for_extend(batch)
    return out_cache_loc


def alloc_for_decode(stack: Any, reqs: Sequence[Any], seq_lens: Sequence[int]) -> torch.Tensor:
    """``alloc_for_decode`` of one token per request, at position ``seq_lens[i]``."""
    from sglang.srt.mem_cache import common

    batch = _batch(stack, reqs)
    batch.req_pool_indices = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)
    batch.seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    return common.alloc_for_decode(batch, token_per_req=1)


def req_to_token_rows(stack: Any, reqs: Sequence[Any], lens: Sequence[int]) -> List[torch.Tensor]:
    """Each request's ``req_to_token`` row up to its length (int64)."""
    rows = stack.req_to_token_pool.req_to_token
    return [rows[req.req_pool_idx, :n].to(torch.int64) for req, n in zip(reqs, lens)]
