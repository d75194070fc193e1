"""The 0.5.23 startup self-test on real CPU gloo ranks (cp 2), through its hook.

Each rank builds the server side as a sharded prefill rank has it (a real
``PageInterleaveDSATokenToKVPool`` over the gloo shard group, the published DSA model config
and runtime context of :func:`~sglang_cp_hicache.testing.v0_5_23.read_path.rank.read_path_session`,
the plugin's flag on the record) and calls the hook AFTER ``ModelRunner.init_attention_backends``
with a model runner carrying those attributes (``selftest_runner``: a real ``ModelRunner``
loads a model onto a GPU). The self-test then runs upstream's real pools, gather, translation, backend and
``forward_extend`` with the CPU kernel set the runtime registered (the read path's torch
stand-ins), bf16 (``flashmla_sparse``). What ``scripts/gpu/device_check.sh --cpu --sglang
0.5.23`` runs on each rank is checked in ``test_gpu_device_check_rank_multi_rank.py``.

Planted faults, patched into upstream's classes (or the kernel set) in each rank process,
must refuse with the stage that catches them, naming the backend and the rank: a wrong-owner
block and an off-by-one page in the attention table (``translation``), a skipped prefix
gather of the last layer (``gather``), a kernel whose result depends on the rows it is given
(``attention``), and the same kernel on rank 1 only (rank 0 refuses too, naming rank 1).
The scratch line the hook logs carries upstream's charge and what the pool really allocated.
"""

import contextlib
import logging
import time

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks
from sglang_cp_hicache.testing.v0_5_23.read_path import faults

CP_SIZE = 2
STALE_LAYER = 2  # the last of three: its slot still holds layer 0's prefix
FAULTS = ("wrong_owner", "off_by_one_page", "stale_layer", "wrong_kernel")
EXPECTED_STAGE = {
    "wrong_owner": "translation",
    "off_by_one_page": "translation",
    "stale_layer": "gather",
    "wrong_kernel": "attention",
}


@contextlib.contextmanager
def _row_dependent_kernel():
    """The CPU kernel set with a FlashMLA sparse kernel whose output depends on the row
    numbers it reads (right on the logical table, wrong on the translated one)."""
    from sglang_cp_hicache.testing.v0_5_23 import selftest_kernels
    from sglang_cp_hicache.v0_5_23.selftest import kv_shard_selftest

    class RowDependentKernels(selftest_kernels.CpuStandInKernels):
        name = "row-dependent-flashmla"

        @contextlib.contextmanager
        def installed(self, cp_group):
            import importlib

            with super().installed(cp_group):
                module = importlib.import_module("sglang.kernels.ops.attention.flash_mla_interface")
                right = module.flash_mla_sparse_fwd

                def wrong(q, kv, indices, *args, **kwargs):
                    out, max_logits, lse = right(q, kv, indices, *args, **kwargs)
                    return out + (indices.clamp(min=0).float().mean() / 64).to(out.dtype), max_logits, lse

                module.flash_mla_sparse_fwd = wrong
                try:
                    yield
                finally:
                    module.flash_mla_sparse_fwd = right

    registry = kv_shard_selftest.SELFTEST_KERNELS
    registry["cpu"] = RowDependentKernels
    try:
        yield
    finally:
        registry["cpu"] = selftest_kernels.CpuStandInKernels


def _first_prefix_page_one_page_on(pool, loc, rows):
    """The first prefix page's rows point at its scratch neighbour."""
    first = int(loc.flatten()[0]) // pool.page_size
    return torch.where(loc.long() // pool.page_size == first, rows + pool.page_size, rows)


def _planted(fault):
    if fault == "wrong_owner":
        return faults.scratch_table_rewritten(faults.wrong_owner)
    if fault == "off_by_one_page":
        return faults.scratch_table_rewritten(_first_prefix_page_one_page_on)
    if fault == "stale_layer":
        return faults.prefetch_skipped(lambda pool, layer_id: layer_id == STALE_LAYER)
    assert fault == "wrong_kernel"
    return _row_dependent_kernel()


def _run_hook(runner):
    """The hook, timed from a barrier (so a rank's figure is its own work)."""
    import torch.distributed as dist

    from sglang_cp_hicache.v0_5_23.selftest import kv_shard_selftest

    dist.barrier()
    start = time.perf_counter()
    try:
        kv_shard_selftest.init_attention_backends_after(None, runner)
        return {"report": getattr(runner, kv_shard_selftest.SELFTEST_ATTR), "seconds": time.perf_counter() - start}
    except kv_shard_selftest.KvShardSelfTestFailed as refusal:
        return {"stage": refusal.stage, "backend": refusal.backend, "rank": refusal.rank, "message": str(refusal)}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _scratch_charge(runner, pool):
    """Upstream's own formula (``compute_page_shard_scratch_bytes``: two slots x rows x
    ``_page_shard_row_bytes``) and the bytes the pool's slots really hold."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.page_interleave import _page_shard_row_bytes

    kvc = SimpleNamespace(model_config=runner.model_config, kv_cache_dtype=pool.dtype, use_mla_backend=True)
    allocated = sum(t.numel() * t.element_size() for slot in pool._slots for t in slot.tensors.values())
    rows, row_bytes = pool.shard_spec.scratch_rows, _page_shard_row_bytes(kvc)
    return {"charged": 2 * rows * row_bytes, "allocated": allocated, "rows": rows, "row_bytes": row_bytes}


def _rank(ctx):
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import FLASHMLA_SPARSE_BF16
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.selftest_kernels import selftest_runner
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    group = GlooShardGroup.from_rank_context(ctx)
    results = {}
    with read_path_session(group, kv_format=FLASHMLA_SPARSE_BF16) as rank:
        runner = selftest_runner(rank)
        lines = _Lines()
        scratch_logger = logging.getLogger("sglang_cp_hicache.v0_5_23.selftest.kv_shard_scratch")
        scratch_logger.addHandler(lines)
        scratch_logger.setLevel(logging.INFO)
        try:
            results["bf16"] = _run_hook(runner)
        finally:
            scratch_logger.removeHandler(lines)
        results["scratch_lines"] = lines.lines
        results["scratch_charge"] = _scratch_charge(runner, runner.token_to_kv_pool)
        for fault in FAULTS:
            with _planted(fault):
                results[fault] = _run_hook(selftest_runner(rank))
        with _row_dependent_kernel() if ctx.rank == 1 else contextlib.nullcontext():
            results["fault_on_rank_1_only"] = _run_hook(selftest_runner(rank))
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(CP_SIZE, _rank, timeout_s=400.0)


def test_the_selftest_passes_every_stage_with_the_reference_kernels(per_rank):
    for rank, results in enumerate(per_rank):
        outcome = results["bf16"]
        assert "report" in outcome, f"rank {rank}: {outcome}"
        report = outcome["report"]
        assert report.backend.startswith("flashmla_sparse/bf16") and report.kernels == "cpu-torch-stand-ins"
        assert (report.rank, report.cp_size) == (rank, CP_SIZE)
        assert report.stages == ["gather", "indexer", "translation", "attention"]
        assert 0 < report.seconds <= outcome["seconds"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_fault_refuses_naming_the_stage_backend_and_rank(per_rank, fault):
    for rank, results in enumerate(per_rank):
        refusal = results[fault]
        assert refusal.get("stage") == EXPECTED_STAGE[fault], f"rank {rank}: {refusal}"
        assert refusal["rank"] == rank and "flashmla_sparse/bf16" in refusal["backend"], refusal
        assert "Refusing to serve" in refusal["message"]
    if fault == "stale_layer":
        assert f"layer {STALE_LAYER}:" in per_rank[0][fault]["message"]


def test_a_fault_on_one_rank_refuses_on_every_rank_naming_it(per_rank):
    for rank, results in enumerate(per_rank):
        refusal = results["fault_on_rank_1_only"]
        assert refusal.get("stage") == "attention" and refusal["rank"] == 1, f"rank {rank}: {refusal}"
    assert "reported by CP rank 1" in per_rank[0]["fault_on_rank_1_only"]["message"]


def test_the_scratch_upstream_charged_is_logged_once_with_its_figure(per_rank):
    for rank, results in enumerate(per_rank):
        charge = results["scratch_charge"]
        assert charge["charged"] == charge["allocated"]  # upstream's charge is what its pool holds
        (line,) = results["scratch_lines"]
        gib = charge["charged"] / 1024**3
        assert line.startswith(f"CP rank {rank}/{CP_SIZE}: KV-shard scratch: {gib:.2f} GiB per rank (bfloat16")
        assert f"2 slots x {charge['rows']} rows x {charge['row_bytes']} B)" in line, line
