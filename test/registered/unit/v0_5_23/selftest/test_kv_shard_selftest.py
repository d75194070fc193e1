"""The 0.5.23 startup self-test's hook, batch, kernel sets, first-mismatch finder and scratch
line, in one process.

The comparison itself runs across gloo ranks in
``test/registered/multi_rank/v0_5_23/selftest/test_kv_shard_selftest_multi_rank.py``.
"""

import logging
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.core.rotation import lane_of, owner_of
from sglang_cp_hicache.v0_5_23.selftest import kv_shard_selftest
from sglang_cp_hicache.v0_5_23.selftest.kv_shard_selftest_batch import (
    SelfTestBatchSpec,
    build_selftest_batch,
)
from sglang_cp_hicache.v0_5_23.selftest import kv_shard_scratch

PAGE = 64


def _runner(*, flag: bool, pool, is_draft_worker: bool = False, context_len: int = 131072):
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

    server_args = ServerArgs(model_path="dummy")
    if flag:
        set_cp_shared_kv_enabled(server_args, True)
    return SimpleNamespace(
        server_args=server_args,
        is_draft_worker=is_draft_worker,
        token_to_kv_pool=pool,
        model_config=SimpleNamespace(context_len=context_len),
        spec_algorithm=SpeculativeAlgorithm.from_string(None),
    )


@pytest.fixture
def nothing_may_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the self-test ran")

    for name in ("run_selftest", "sharded_pool_of"):
        monkeypatch.setattr(kv_shard_selftest, name, refuse)
    monkeypatch.setattr(kv_shard_scratch, "log_startup_scratch", refuse)


@pytest.mark.parametrize("flag, draft", [(False, False), (False, True), (True, True)])
def test_flag_off_or_a_draft_worker_runs_nothing(nothing_may_run, caplog, flag, draft):
    runner = _runner(flag=flag, pool=object(), is_draft_worker=draft)
    with caplog.at_level(logging.INFO, logger="sglang_cp_hicache"):
        assert kv_shard_selftest.init_attention_backends_after("result", runner) is None
    assert not hasattr(runner, kv_shard_selftest.SELFTEST_ATTR)
    assert caplog.records == []


@pytest.fixture
def published_context():
    from sglang.srt.runtime_context import restore_context, snapshot_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    before = snapshot_context()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))  # the pool reads it
    try:
        yield
    finally:
        restore_context(before)


def test_under_the_flag_an_unsharded_pool_refuses_to_serve(published_context):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    pool = DSATokenToKVPool(
        4 * PAGE, page_size=PAGE, kv_lora_rank=32, dtype=torch.bfloat16, qk_rope_head_dim=16,
        layer_num=1, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=48,
    )
    with pytest.raises(kv_shard_selftest.KvShardSelfTestFailed, match="DSATokenToKVPool.*not KV-sharded") as err:
        kv_shard_selftest.init_attention_backends_after(None, _runner(flag=True, pool=pool))
    assert err.value.stage == "pool"


def test_the_cpu_runtime_registers_its_kernel_set_and_an_unknown_device_refuses():
    from sglang_cp_hicache.testing.v0_5_23.selftest_kernels import CpuStandInKernels

    assert isinstance(kv_shard_selftest.kernels_for(torch.device("cpu"), "b", 0), CpuStandInKernels)
    assert kv_shard_selftest.SELFTEST_KERNELS["cuda"] is kv_shard_selftest.UpstreamCudaKernels
    with pytest.raises(kv_shard_selftest.KvShardSelfTestFailed) as err:
        kv_shard_selftest.kernels_for(torch.device("meta"), "flashmla_sparse/bf16", 3)
    assert (err.value.stage, err.value.backend, err.value.rank) == ("kernels", "flashmla_sparse/bf16", 3)
    assert "CP rank 3" in str(err.value) and "Refusing to serve" in str(err.value)


@pytest.mark.parametrize("cp_size", [2, 3, 8])
def test_the_batch_has_the_shapes_the_sharded_read_path_must_handle(cp_size):
    spec = SelfTestBatchSpec()
    batch = build_selftest_batch(spec, cp_size, PAGE)
    again = build_selftest_batch(spec, cp_size, PAGE)  # seeded: the same on every rank
    assert torch.equal(batch.req_to_token, again.req_to_token)
    assert all(p % PAGE == 0 for p in batch.prefix_lens) and any(batch.prefix_lens)
    assert all(s % PAGE for s in batch.seq_lens)  # every chunk ends mid-page
    rows = batch.req_to_token.long()
    shared = spec.shared_prefix_pages * PAGE
    assert torch.equal(rows[0, :shared], rows[1, :shared])  # a radix hit
    all_pages = set()
    for i, seq_len in enumerate(batch.seq_lens):
        pages = rows[i, :seq_len:PAGE] // PAGE
        owners = lane_of(pages, cp_size)
        assert torch.equal(owners, owner_of(int(owners[0]), torch.arange(len(pages)), cp_size))  # one run
        assert int((pages // cp_size).min()) >= 1  # local page 0 is every rank's trash page
        assert int((pages // cp_size).max()) <= batch.pages_per_rank
        assert torch.equal(rows[i, :seq_len] % PAGE, torch.arange(seq_len) % PAGE)
        all_pages |= set(pages.tolist()) if i != 1 else set(pages[spec.shared_prefix_pages:].tolist())
    distinct = sum(-(-s // PAGE) for s in batch.seq_lens) - spec.shared_prefix_pages
    assert len(all_pages) == distinct  # no page is handed out twice
    assert len(batch.out_cache_loc) == sum(batch.extend_lens)


def test_the_startup_scratch_line_for_glm5_at_128k(caplog):
    """The live pool's spec as ``make_page_shard_spec`` builds it for GLM-5 at 128K, cp 8,
    chunk 8192: 2.53 GiB per rank in bf16 (1.55 GiB in fp8, without MTP)."""
    from sglang.srt.mem_cache.page_interleave import _KV_SHARD_SCRATCH_PREFIX_CONTEXTS, PageShardSpec

    spec = PageShardSpec(
        shard_rank=5, shard_size=8, page_size=PAGE,
        max_prefix_tokens=_KV_SHARD_SCRATCH_PREFIX_CONTEXTS * 131072, chunk_tokens=8192,
    )
    lines = {}
    for fp8, name in ((False, "bfloat16"), (True, "fp8_e4m3")):
        pool = SimpleNamespace(
            shard_spec=spec, shard_rank=5, shard_size=8, dsa_kv_cache_store_fp8=fp8,
            kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128,
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=kv_shard_scratch.__name__):
            figure = kv_shard_scratch.log_startup_scratch(_runner(flag=True, pool=pool), pool)
        (record,) = caplog.records
        lines[name] = record.getMessage()
        expected = kv_shard_scratch.dsa_scratch_figure(
            kv_cache_dtype=name, context_len=131072, chunked_prefill_size=8192, shard_size=8
        )
        assert figure == expected
    assert lines["bfloat16"].startswith("CP rank 5/8: KV-shard scratch: 2.53 GiB per rank (bfloat16")
    assert lines["fp8_e4m3"].startswith("CP rank 5/8: KV-shard scratch: 1.55 GiB per rank (fp8_e4m3")


def _record(**changed):
    """One layer's record of small distinct tensors; ``changed`` replaces fields."""
    base = dict(
        gather_kv=torch.arange(8, dtype=torch.uint8),
        gather_index=torch.arange(8, 16, dtype=torch.uint8),
        index_read=(torch.arange(16, 24, dtype=torch.uint8), torch.arange(24, 28, dtype=torch.uint8)),
        topk=torch.tensor([[3, 1, -1]], dtype=torch.int32),
        table_rows=torch.arange(28, 36, dtype=torch.uint8),
        attention=torch.arange(36, 44, dtype=torch.uint8),
    )
    base.update(changed)
    return kv_shard_selftest.LayerRecord(**base)


@pytest.mark.parametrize(
    "changed, what",
    [
        ({"index_read": (torch.arange(17, 25, dtype=torch.uint8), torch.arange(24, 28, dtype=torch.uint8))},
         "index-K keys read"),
        ({"index_read": (torch.arange(16, 24, dtype=torch.uint8), torch.tensor([24, 25, 26, 0], dtype=torch.uint8))},
         "index-K scales read"),
        ({"topk": torch.tensor([[1, 3, -1]], dtype=torch.int32)}, "top-k"),
        ({"topk": torch.tensor([[3, 1]], dtype=torch.int32)}, "top-k"),  # a shape differs
    ],
)
def test_the_first_mismatch_of_records_differing_only_in_the_indexer_is_the_indexer_stage(changed, what):
    """Layer 0 equal, layer 1 differs only in what the indexer read or selected: the
    finder names the indexer stage and the field, not a later stage or a pass."""
    replicated = kv_shard_selftest.SideRun(records=[_record(), _record()])
    sharded = kv_shard_selftest.SideRun(records=[_record(), _record(**changed)])
    assert kv_shard_selftest._first_mismatch(replicated, replicated) is None
    stage, detail = kv_shard_selftest._first_mismatch(sharded, replicated)
    assert stage == "indexer" and detail.startswith(f"layer 1: {what} differ"), (stage, detail)
