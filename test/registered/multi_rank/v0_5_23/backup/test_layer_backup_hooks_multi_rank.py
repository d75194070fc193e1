"""The plugin's ``Scheduler.run_batch`` and ``ModelRunner.forward`` hooks of per-layer D2H
backup (``v0_5_23/backup/layer_backup.py``), called with the real objects they receive,
on the REAL 0.5.23 sharded stack across gloo CP ranks.

``run_batch_around`` gets a real extend ``ScheduleBatch`` (real ``Req`` objects admitted by a
``PrefillAdder``, slots from ``alloc_for_extend``); ``model_forward_around`` gets its real
``ForwardBatch``. Only what needs a GPU is stood in: the model (it stores each layer's KV
through the sharded pool's own ``set_mla_kv_buffer``, whose hook backs the layer up) and
the scheduler and the model runner around them (the hooks read the scheduler's
``tree_cache`` and the runner's ``token_to_kv_pool``). Contract: host slots
reserved before the forward, one ack after its last layer, a skipped layer or a forward left
mid-way fails fast; flag off, each hook is upstream's call and nothing else. Every test
runs on both host layouts, ``layer_first`` and ``page_first``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LAYERS = 2
SEED = 20261202
_A = list(range(1, 5 * PAGE + 1))  # five pages: both ranks own some
_C = list(range(20_001, 20_001 + PAGE))  # one page: one rank owns none of it
FAILURES = ("skips_layer0", "ends_after_layer0", "raises_after_layer0")
LAYOUTS = ("layer_first", "page_first")


def _stack(ctx: RankContext, cp_shared_kv: bool, layout: str):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    return sharded_stack(ctx, StackConfig(layer_num=LAYERS, cp_shared_kv=cp_shared_kv, mem_layout=layout))


class FakeModel:
    """The model's part of ``ModelRunner.forward`` (it needs a GPU): every layer's KV stores
    over the forward batch's new slots through the pool's own door (``stop_after``: only
    the first layers; ``skip``: layers never stored; ``error``: raised after the stores)."""

    def __init__(self, stack, stop_after: int = LAYERS, skip=(), error: Optional[BaseException] = None) -> None:
        self.stack, self.stop_after, self.skip, self.error = stack, stop_after, skip, error
        self.calls: List[tuple] = []

    def __call__(self, runner, forward_batch, *args, **kwargs):
        from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import store_layer
        from sglang_cp_hicache.testing.v0_5_23.owned_kv import logical_kv

        self.calls.append((runner, forward_batch, args, kwargs))
        locs = forward_batch.out_cache_loc
        kv = logical_kv(self.stack, len(locs), LAYERS, SEED + int(locs[0]))
        for layer in range(self.stop_after):
            if layer not in self.skip:
                store_layer(self.stack, layer, [(locs, kv)])
        if self.error is not None:
            raise self.error
        return "model output"


def _runner(stack) -> SimpleNamespace:
    """What the hook reads of the ``ModelRunner`` (it needs a GPU): its KV pool."""
    return SimpleNamespace(token_to_kv_pool=stack.kv_pool)


def _host_mismatches(stack, device_locs: torch.Tensor, host_locs: torch.Tensor) -> int:
    """Owned latent rows whose host copy differs from the device's, over every layer."""
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import host_latent_layer

    owned = stack.owned_mask(device_locs)
    device_rows = stack.physical_rows(device_locs)
    host_rows = stack.placement.local_index(host_locs[owned])
    bad = 0
    for layer in range(LAYERS):
        device = stack.kv_pool.kv_buffer[layer][device_rows]
        host = host_latent_layer(stack.kv_host_pool, layer)[host_rows].view(device.dtype).reshape(device.shape)
        bad += int((host != device).flatten(1).any(1).sum())
    return bad


def flag_on(ctx: RankContext, layout: str) -> Dict[str, object]:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import (
        extend_batch,
        finish_request,
        forward_batch_of,
    )
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import (
        layer_backup_of,
        model_forward_around,
        run_batch_around,
    )

    report: Dict[str, object] = {}
    with _stack(ctx, True, layout) as stack:
        cache, queue = stack.cache, stack.controller.ack_write_queue
        backup = layer_backup_of(cache)
        scheduler = SimpleNamespace(tree_cache=cache)  # what the hook reads of the Scheduler
        host_free = stack.host_available()
        batch = extend_batch(stack, [_A, _C])
        forward_batch = forward_batch_of(stack, batch)
        model = FakeModel(stack)
        seen: Dict[str, object] = {}

        def upstream_run_batch(scheduler_arg, batch_arg, *args, **kwargs):
            seen["args"] = (scheduler_arg is scheduler, batch_arg is batch, args, kwargs)
            seen["reserved_rids"] = backup.reservations.rids()
            seen["held"] = list(backup.pipeline.held_ack_ids)
            seen["riding"] = [t in cache.ongoing_write_through for t in seen["held"]]
            seen["host_taken"] = host_free - stack.host_available()
            seen["acks_before"] = len(queue)
            seen["model"] = model_forward_around(model, _runner(stack), forward_batch)
            return "batch result"

        report["result"] = run_batch_around(upstream_run_batch, scheduler, batch, "pp", key=1)
        report["seen"] = seen
        report["model_got_the_forward_batch"] = model.calls[0][1] is forward_batch
        report["acks"] = [list(ack.node_ids) for ack in queue[seen["acks_before"]:]]
        report["owned_c_pages"] = int(stack.owned_mask(forward_batch.out_cache_loc[5 * PAGE :: PAGE]).sum())
        locs = [stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(p)].to(torch.int64)
                for req, p in zip(batch.reqs, (_A, _C))]  # fmt: skip
        for req in batch.reqs:
            finish_request(cache, req)
        nodes = [cache.tree_core.node_by_id(stack.match(p).last_device_node) for p in (_A, _C)]
        report["pending_before_ack"] = [n.write_through_pending_id is not None for n in nodes]
        cache.writing_check()
        report["published_at_ack"] = [n.write_through_pending_id is None and n.backuped for n in nodes]
        report["in_flight_after_ack"] = backup.reservations.tickets_in_flight()
        report["host_mismatches"] = [
            _host_mismatches(stack, loc, n.component_data[ComponentType.FULL].host_value) for loc, n in zip(locs, nodes)
        ]
        # Not an extend (a decode batch), and no batch: upstream's call, nothing reserved.
        calls = []
        decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=batch.reqs)
        for other in (decode, None):
            run_batch_around(lambda s, b: calls.append(list(backup.pipeline.held_ack_ids)), scheduler, other)
        report["non_extend_held"] = calls
        report["failures"] = {how: _failure(stack, scheduler, how) for how in FAILURES}
    return report


def _failure(stack, scheduler, how: str) -> str:
    """A forward through both hooks whose model skips layer 0, ends after it, or raises
    after it: the error the hooks raise (type, message, cause)."""
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import extend_batch, forward_batch_of
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import model_forward_around, run_batch_around

    first = 40_001 + 1_000 * FAILURES.index(how)
    batch = extend_batch(stack, [list(range(first, first + 2 * PAGE))], rid_prefix=how)
    model = {
        "skips_layer0": FakeModel(stack, skip=(0,)),
        "ends_after_layer0": FakeModel(stack, stop_after=1),
        "raises_after_layer0": FakeModel(stack, stop_after=1, error=RuntimeError("CUDA error")),
    }[how]
    forward_batch = forward_batch_of(stack, batch)
    try:
        run_batch_around(lambda s, b: model_forward_around(model, _runner(stack), forward_batch), scheduler, batch)
    except BaseException as error:  # noqa: BLE001 - the test reports whatever came out
        cause = error.__cause__
        return f"{type(error).__name__}: {error} | cause {type(cause).__name__ if cause else None}"
    return "no error"


def flag_off(ctx: RankContext, layout: str) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import extend_batch, forward_batch_of
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import (
        layer_backup_of,
        model_forward_around,
        run_batch_around,
    )

    report: Dict[str, object] = {}
    with _stack(ctx, False, layout) as stack:
        cache, queue = stack.cache, stack.controller.ack_write_queue
        report["attached"] = layer_backup_of(cache) is not None
        batch = extend_batch(stack, [_A])
        forward_batch = forward_batch_of(stack, batch)
        host_free, acks = stack.host_available(), len(queue)
        calls = []

        def upstream_run_batch(*args, **kwargs):
            calls.append((args, kwargs, dict(cache.ongoing_write_through), stack.host_available()))
            return "batch result"

        scheduler = SimpleNamespace(tree_cache=cache)
        report["run_batch"] = run_batch_around(upstream_run_batch, scheduler, batch, "pp", key=1)
        (args, kwargs, ongoing, host_inside), = calls
        same_objects = args[0] is scheduler and args[1] is batch
        report["run_batch_call"] = (same_objects, args[2:], kwargs, ongoing, host_inside == host_free)
        model = FakeModel(stack)
        report["forward"] = model_forward_around(model, _runner(stack), forward_batch, "proxy", split_forward_count=1)
        runner, fb, args, kwargs = model.calls[0]
        report["forward_call"] = (runner.token_to_kv_pool is stack.kv_pool, fb is forward_batch, args, kwargs)
        report["acks_appended"] = len(queue) - acks
        try:
            failing = FakeModel(stack, stop_after=1, error=RuntimeError("CUDA error"))
            model_forward_around(failing, _runner(stack), forward_batch)
        except BaseException as error:  # noqa: BLE001
            report["raised"] = f"{type(error).__name__}: {error}"
    return report


def scenario(ctx: RankContext, layout: str) -> Dict[str, object]:
    return {"on": flag_on(ctx, layout), "off": flag_off(ctx, layout)}


@pytest.fixture(scope="module", params=LAYOUTS)
def reports(request) -> List[Dict[str, object]]:
    return run_ranks(2, scenario, request.param)


@pytest.fixture(scope="module")
def on(reports):
    return [r["on"] for r in reports]


def test_run_batch_reserves_before_the_forward_and_returns_upstreams_result(on):
    for rank, report in enumerate(on):
        seen = report["seen"]
        assert report["result"] == "batch result" and seen["args"] == (True, True, ("pp",), {"key": 1}), f"rank {rank}"
        assert seen["reserved_rids"] == ["r0", "r1"], f"rank {rank}: not reserved before the forward"
        assert len(seen["held"]) == 2 and seen["riding"] == [True, True], f"rank {rank}"
        assert seen["host_taken"] == len(_A) + len(_C), f"rank {rank}: host slots for the new pages"
        assert seen["model"] == "model output" and report["model_got_the_forward_batch"], f"rank {rank}"


def test_one_ack_after_the_last_layer_on_every_rank_then_published_byte_exact(on):
    assert sorted(r["owned_c_pages"] for r in on) == [0, 1]  # C: one rank owns none and acks too
    for rank, report in enumerate(on):
        assert report["acks"] == [report["seen"]["held"]], f"rank {rank}: one ack with both tickets"
        assert report["pending_before_ack"] == [True, True], f"rank {rank}"
        assert report["published_at_ack"] == [True, True], f"rank {rank}"
        assert report["in_flight_after_ack"] == [], f"rank {rank}"
        assert report["host_mismatches"] == [0, 0], f"rank {rank}"


def test_run_batch_reserves_nothing_for_a_batch_that_is_no_extend(on):
    for rank, report in enumerate(on):
        assert report["non_extend_held"] == [[], []], f"rank {rank}"


@pytest.mark.parametrize(
    "how, expected",
    [
        ("skips_layer0", "reported layer 1 before layer 0"),
        ("ends_after_layer0", "1/2 layers submitted): the model forward ended"),
        ("raises_after_layer0", "1/2 layers submitted): the model forward raised | cause RuntimeError"),
    ],
)
def test_a_forward_that_skips_a_layer_or_stops_mid_way_fails_fast(on, how, expected):
    for rank, report in enumerate(on):
        message = report["failures"][how]
        assert message.startswith("PerLayerBackupIncomplete") and f"CP rank {rank}" in message, message
        assert expected in message, message


def test_flag_off_each_hook_is_upstreams_call_only(reports):
    for rank, report in enumerate(r["off"] for r in reports):
        assert not report["attached"], f"rank {rank}"
        assert report["run_batch"] == "batch result"
        assert report["run_batch_call"] == (True, ("pp",), {"key": 1}, {}, True), f"rank {rank}"
        assert report["forward"] == "model output"
        assert report["forward_call"] == (True, True, ("proxy",), {"split_forward_count": 1}), f"rank {rank}"
        assert report["acks_appended"] == 0, f"rank {rank}"
        assert report["raised"] == "RuntimeError: CUDA error", f"rank {rank}"
