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
from typing import Any, Iterator, Sequence

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
    return extend_batch(stack, reqs, seq_lens).out_cache_loc


def extend_batch(stack: Any, reqs: Sequence[Any], seq_lens: Sequence[int]) -> Any:
    """An EXTEND ``ScheduleBatch`` after ``alloc_for_extend``, with the fields
    ``prepare_for_extend`` sets that ``get_model_worker_batch`` hands on (requests are real
    ``Req``s here)."""
    from sglang.srt.mem_cache import common
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = _batch(stack, reqs)
    batch.forward_mode = ForwardMode.EXTEND
    batch.prefix_lens = [len(req.prefix_indices) for req in reqs]
    batch.extend_lens = [seq - pre for seq, pre in zip(seq_lens, batch.prefix_lens)]
    batch.extend_num_tokens = sum(batch.extend_lens)
    batch.seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    batch.seq_lens_sum = int(sum(seq_lens))
    batch.extend_logprob_start_lens = [0] * len(reqs)
    batch.out_cache_loc, batch.req_pool_indices, _ = common.alloc_for_extend(batch)
    batch.input_ids = torch.zeros(batch.extend_num_tokens, dtype=torch.int64)
    return batch


def forward_batch(stack: Any, batch: Any) -> Any:
    """SGLang's ``ForwardBatch`` of a prepared batch, made the way the TP worker makes it:
    ``ForwardBatch.init_new(batch.get_model_worker_batch(), model_runner)`` (both looked up
    at call time, so the plugin's hooks run). The model runner stands for a CPU one with
    the stack's pools and no attention backend; the process has no MoE expert-parallel
    group, so its size is taken as 1 (``enable_num_token_non_padded`` asks it)."""
    from unittest import mock

    from sglang.srt.model_executor import forward_batch_info

    model_runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool=stack.kv_pool,
        token_to_kv_pool_allocator=stack.allocator,
        attn_backend=None,
        server_args=SimpleNamespace(attention_backend="torch_native", enable_lora=False),
        use_ngram_embedding=False,
        model_is_mrope=False,
        is_hybrid_swa=False,
    )
    worker_batch = batch.get_model_worker_batch()
    with mock.patch.object(forward_batch_info, "enable_num_token_non_padded", return_value=False):
        return forward_batch_info.ForwardBatch.init_new(worker_batch, model_runner)


def alloc_for_decode(stack: Any, reqs: Sequence[Any], seq_lens: Sequence[int]) -> torch.Tensor:
    """``alloc_for_decode`` of one token per request, at position ``seq_lens[i]``."""
    from sglang.srt.mem_cache import common

    batch = _batch(stack, reqs)
    batch.req_pool_indices = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)
    batch.seq_lens_cpu = torch.tensor(list(seq_lens), dtype=torch.int64)
    batch.seq_lens = batch.seq_lens_cpu.clone()
    return common.alloc_for_decode(batch, token_per_req=1)
