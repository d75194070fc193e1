"""testing/v0_5_23/gpu_selftest.py, the 0.5.23 GPU check's rank and main-process work, on CPU:
the host-staged gather, the startup self-test through its hook at GLM-5's geometry on two
gloo ranks (the CPU runtime's kernel set; on the GPU host the same code runs SGLang's CUDA
kernels), and the kvcacheio round trips against the CPU runtime's reference ops, which
follow sglang-kernel's addressing.
"""

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks
from sglang_cp_hicache.testing.v0_5_23 import gpu_selftest

CPU = torch.device("cpu")


def gather_rank(ctx):
    """Every rank's block in place, rank-major, a non-contiguous-dtype (bf16) payload."""
    group = gpu_selftest.shard_group_on(ctx, CPU)
    comm = gpu_selftest.HostStagedGather(group=group.cpu_group, device=CPU)
    out = torch.zeros(group.world_size * 3, 2, dtype=torch.bfloat16)
    block = out[group.rank_in_group * 3 : (group.rank_in_group + 1) * 3]
    block.copy_(torch.full((3, 2), float(group.rank_in_group + 1)))
    comm.all_gather(out, block)
    with comm.change_state(enable=False):
        untouched = torch.zeros(group.world_size, dtype=torch.int64)
        comm.all_gather(untouched, torch.ones(1, dtype=torch.int64))
    return out, untouched


def test_the_host_staged_gather_is_in_place_and_rank_major():
    results = run_ranks(3, gather_rank, timeout_s=60)
    expected = torch.repeat_interleave(torch.tensor([1.0, 2.0, 3.0]), 3)[:, None].expand(9, 2).to(torch.bfloat16)
    for out, untouched in results:
        assert torch.equal(out, expected)
        assert not untouched.any()  # disabled: a no-op, as NCCL's


def selftest_rank(ctx):
    return gpu_selftest.run_selftests(gpu_selftest.shard_group_on(ctx, CPU))


def test_the_selftest_passes_every_format_at_glm5_geometry_through_the_staged_gathers():
    per_rank = run_ranks(2, selftest_rank, timeout_s=300)
    for entries in per_rank:
        assert [(e["format"], e["topk"]) for e in entries] == [
            ("flashmla_sparse/bfloat16", "torch"), ("flashmla_kv/fp8_e4m3", "torch"),
        ]  # fmt: skip
        for entry in entries:
            assert entry["selftest"]["ok"], entry
            assert entry["selftest"]["stages"] == ["gather", "indexer", "translation", "attention"]


def test_the_gpu_geometry_and_topk_paths_are_what_the_cuda_kernels_need():
    formats = gpu_selftest.gpu_kv_formats()
    assert [f.name for f in formats] == ["flashmla_sparse/bfloat16", "flashmla_kv/fp8_e4m3"]
    for f in formats:  # FlashMLA's d_qk 576, the fused top-k kernels' 2048, GLM-5's 64 heads
        assert (f.config.kv_lora_rank, f.config.qk_rope_head_dim, f.config.index_topk) == (512, 64, 2048)
        assert f.config.num_heads == 64
    assert gpu_selftest.topk_paths(torch.device("cuda")) == gpu_selftest.CUDA_TOPK_PATHS
    assert {env["SGLANG_OPT_USE_TOPK_V2"] for _, env in gpu_selftest.CUDA_TOPK_PATHS.values()} == {True, False}
    assert gpu_selftest.topk_paths(CPU) == gpu_selftest.CPU_TOPK_PATHS


def test_kvcacheio_round_trips_are_exact_on_the_reference_ops():
    report = gpu_selftest.kvcacheio_check(CPU)
    assert report == {
        "ok": True,
        "cases": sorted(f"{kind}/{layout}" for kind in gpu_selftest.KVCACHEIO_ITEMS for layout in ("layer_first", "page_first")),
        "problems": [],
    }


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_kvcacheio_reports_a_transfer_that_misplaces_bytes(monkeypatch, layout):
    ops = gpu_selftest.kvcacheio_ops(CPU)
    per_layer = "transfer_kv_per_layer_mla" if layout == "layer_first" else "transfer_kv_per_layer_mla_pf_lf"
    real = getattr(ops, per_layer)

    def shifted(**kwargs):  # every load lands one index further
        real(**dict(kwargs, dst_indices=(kwargs["dst_indices"] + 1) % 1024))

    monkeypatch.setattr(ops, per_layer, shifted)
    problems = gpu_selftest.kvcacheio_round_trip(gpu_selftest.KvcacheioCase("latent_bf16", 1152, layout), CPU)
    assert any("per-layer load put other bytes on the device" in p for p in problems), problems
    assert any("wrote rows it was not given" in p for p in problems), problems
    assert not any("all-layer backup" in p for p in problems)


def test_a_case_that_raises_is_reported_and_the_others_still_run(monkeypatch):
    ops = gpu_selftest.kvcacheio_ops(CPU)

    def refuse(**kwargs):
        raise TypeError("unexpected keyword argument 'dst_layout_dim'")

    monkeypatch.setattr(ops, "transfer_kv_all_layer_mla_lf_pf", refuse)
    report = gpu_selftest.kvcacheio_check(CPU)
    assert not report["ok"] and len(report["cases"]) == 6
    assert report["problems"] == [
        f"{kind}/page_first: TypeError: unexpected keyword argument 'dst_layout_dim'" for kind in gpu_selftest.KVCACHEIO_ITEMS
    ]
