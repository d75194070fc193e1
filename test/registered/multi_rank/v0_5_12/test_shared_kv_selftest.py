"""Startup self-test on cp 2 gloo ranks (CPU reference kernels): passes on the real read
path and names the failing stage for each planted fault."""

import contextlib

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

GEOMETRIES = {
    "bf16": dict(kv_store_dtype=torch.bfloat16, kv_token_shape=(1, 576), token_bytes=1152),
    "fp8": dict(kv_store_dtype=torch.uint8, kv_token_shape=(1, 656), token_bytes=656),
}
FAULT_STAGES = {
    "rolled_owner": ("write_translation",),
    "dropped_shard": ("materialize_all_reduce", "materialize_all_gather", "round_trip"),
    "wrong_capacity": ("logical_capacity",),
    "stale_dense_buffer": ("materialize_all_reduce", "dense_buffer_clean"),
}


def _geometry(name):
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import PagedLayerGeometry

    g = GEOMETRIES[name]
    return PagedLayerGeometry(
        page_size=64, kv_store_dtype=g["kv_store_dtype"], kv_token_shape=g["kv_token_shape"],
        kv_page_bytes=64 * g["token_bytes"], index_page_bytes=64 * 132,
    )


@contextlib.contextmanager
def _planted(fault):
    from unittest import mock

    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_materialize as mat
    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_selftest as st
    from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_write import translate_out_cache_loc

    if fault is None:
        yield
    elif fault == "rolled_owner":
        def rolled(layout, locs):
            import dataclasses

            rolled_layout = dataclasses.replace(layout, cp_rank=(layout.cp_rank + 1) % layout.cp_size)
            return translate_out_cache_loc(rolled_layout, locs)

        with mock.patch.object(st, "translate_out_cache_loc", rolled):
            yield
    elif fault == "dropped_shard":
        real_gather = mat._gather_pages

        def drop(source, pages, out):
            real_gather(source, pages, out)
            out.zero_()

        with mock.patch.object(mat, "_gather_pages", drop):
            yield
    elif fault == "wrong_capacity":
        with mock.patch.object(hooks, "logical_capacity_size", lambda pool, layout: layout.cp_size * pool.size):
            yield
    elif fault == "stale_dense_buffer":
        real_allocate = mat.DenseLayerKV.allocate.__func__

        def stale(cls, geometry, num_pages, device, zero=True):
            dense = real_allocate(cls, geometry, num_pages, device, zero=False)
            dense.flat.fill_(7)
            return dense

        # A reused buffer whose zeroing is skipped: garbage outside what the collective fills.
        with mock.patch.object(mat.DenseLayerKV, "allocate", classmethod(stale)), mock.patch.object(
            mat.DenseLayerKV, "zero_outside", lambda self, pages: None
        ):
            yield


def _rank(ctx, geometry_name, strategies, faults):
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import (
        SharedKVSelfTestFailed,
        run_selftest,
    )
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

    layout = CpSharedKVLayout(ctx.world_size, ctx.rank, 64)
    results = {}
    for fault in faults:
        for strategy in strategies:
            try:
                with _planted(fault):
                    report = run_selftest(_geometry(geometry_name), layout, ctx.cp_group, strategy, torch.device("cpu"))
                results[(fault, strategy)] = ("pass", tuple(dict.fromkeys(report.stages)), report.seconds)
            except SharedKVSelfTestFailed as exc:
                results[(fault, strategy)] = ("fail", exc.stage, str(exc))
    return results


@pytest.mark.parametrize("geometry", ["bf16", "fp8"])
def test_selftest_passes_on_the_real_read_path(geometry):
    per_rank = run_ranks(2, _rank, geometry, ("all_reduce", "all_gather"), (None,))
    for results in per_rank:
        for (_, strategy), (outcome, stages, seconds) in results.items():
            assert outcome == "pass", (strategy, stages)
            for stage in ("logical_capacity", "write_translation", f"materialize_{strategy}",
                          "dense_buffer_clean", "chunk_store", "GetKAndS", "GetK/GetS",
                          "topk_transform", "sparse_attention", "round_trip"):
                assert stage in stages, (stage, stages)
            assert ("dequantize_k_cache_paged" in stages) == (geometry == "fp8")
            assert ("flashmla_kv" in stages) == (geometry == "fp8")
            assert seconds < 30


def test_each_planted_fault_fails_naming_its_stage():
    faults = tuple(FAULT_STAGES)
    per_rank = run_ranks(2, _rank, "bf16", ("all_reduce", "all_gather"), faults)
    for rank, results in enumerate(per_rank):
        for (fault, strategy), (outcome, stage, message) in results.items():
            assert outcome == "fail", (rank, fault, strategy)
            assert stage in FAULT_STAGES[fault], (rank, fault, strategy, stage)
            assert f"stage '{stage}'" in message and "Refusing to serve" in message


class _StubRunner:
    """A model runner whose ``init_memory_pool`` builds a small NSA-shaped pool."""

    is_draft_worker = False

    def __init__(self):
        self.token_to_kv_pool = None
        self.served = False

    def init_memory_pool(self, pre_model_load_memory):
        from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import SelfTestPool

        self.token_to_kv_pool = SelfTestPool(_geometry("bf16"), num_pages=9, num_layers=2, device=torch.device("cpu"))
        return "pools ready"


def _launch_rank(ctx, fault):
    """What a scheduler rank does at init: the hooked ``init_memory_pool``, then serve."""
    from unittest import mock

    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_selftest as selftest
    from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import SharedKVSelfTestFailed
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

    runtime = hooks.CpSharedKVRuntime(CpSharedKVLayout(ctx.world_size, ctx.rank, 64), ctx.cp_group, "all_gather", False)
    runner = _StubRunner()
    with mock.patch.object(hooks, "startup_runtime", lambda model_runner: runtime), _planted(fault):
        try:
            result = selftest.init_memory_pool_around(_StubRunner.init_memory_pool, runner, 0)
        except SharedKVSelfTestFailed as exc:
            return ("refused", exc.stage)
    runner.served = True
    report = getattr(runner, selftest.SELFTEST_ATTR)
    return ("served", result, report.seconds)


def test_launch_serves_only_after_a_passing_selftest():
    for outcome in run_ranks(2, _launch_rank, None):
        assert outcome[:2] == ("served", "pools ready")
    for outcome in run_ranks(2, _launch_rank, "wrong_capacity"):
        assert outcome == ("refused", "logical_capacity")


def test_selftest_hook_is_registered_on_init_memory_pool():
    from sglang_cp_hicache.v0_5_12.hooks import HOOKS, resolve
    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_selftest as selftest

    targets = {spec.dotted_target: resolve(spec.hook) for spec in HOOKS}
    mixin = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
    assert targets[f"{mixin}.init_memory_pool"] is selftest.init_memory_pool_around
