"""The 0.5.23 CPU runtime: what it installs when, that it installs it once, that every piece
reaches the SGLang module that looks it up, and that it never becomes a platform plugin.
"CUDA present", "the real kernel loads" and "Triton runs" are simulated through the probes;
no GPU is needed."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from sglang_cp_hicache.core.import_watcher import process_watcher
from sglang_cp_hicache.testing import hicache_jit, kvcacheio
from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE
from sglang_cp_hicache.testing.reference_sparse_mla import get_mla_kv_buffer_reference
from sglang_cp_hicache.testing.v0_5_23 import runtime
from sglang_cp_hicache.testing.v0_5_23.runtime import InstallPlan, RealKernelMissing, plan_install
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooGatherCommunicator

CPU_PLAN = InstallPlan(
    kvcacheio_reference_ops=True,
    host_memory_patches=True,
    cpu_device_module=True,
    gloo_gather_communicator=True,
    triton_stand_ins=True,
    hicache_jit_stand_ins=True,
)


def _loads() -> None:
    """Probe stand-in: the real ``sgl_kernel.kvcacheio`` imports."""


def _fails() -> None:
    raise ImportError("libcuda.so.1: cannot open shared object file")


def _never(*_: object) -> bool:
    raise AssertionError("probe must not run")


# ---- the plan ------------------------------------------------------------------------


def test_cuda_with_the_real_kernel_installs_nothing() -> None:
    plan = plan_install(lambda: True, _loads, triton_can_run=_never)
    assert plan.installs_nothing


def test_cuda_with_a_broken_kernel_raises_never_falls_back() -> None:
    with pytest.raises(RealKernelMissing, match="libcuda.so.1") as raised:
        plan_install(lambda: True, _fails, triton_can_run=_never)
    assert isinstance(raised.value.__cause__, ImportError)


def test_cpu_installs_every_piece_whether_or_not_a_kernel_package_imports() -> None:
    # No host-pool module imports sgl_kernel off CUDA, so an importable one changes nothing.
    for probe in (_loads, _fails):
        assert plan_install(lambda: False, probe, triton_can_run=lambda: False) == CPU_PLAN


def test_triton_stand_ins_only_where_triton_cannot_run() -> None:
    plan = plan_install(lambda: False, _never, triton_can_run=lambda: True)
    assert not plan.triton_stand_ins and plan.kvcacheio_reference_ops


def test_this_cpu_process_got_every_piece_once() -> None:
    plan = runtime.install()
    assert plan == CPU_PLAN and runtime.install() is plan
    pending = set(process_watcher().pending())
    runtime.install()
    assert set(process_watcher().pending()) == pending


def test_install_imports_no_sglang() -> None:
    code = (
        "import sys; from sglang_cp_hicache.testing.v0_5_23.runtime import install; "
        "install(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'sglang'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_never_a_platform_plugin() -> None:
    from sglang.srt.platforms import current_platform
    from sglang.srt.platforms.interface import reject_out_of_tree_path

    ours = [ep for ep in entry_points(group="sglang.srt.platforms") if "cp_hicache" in ep.value]
    assert ours == []
    assert not current_platform.is_out_of_tree()
    reject_out_of_tree_path(current_platform, subsystem="logical-page KV sharding")


# ---- each piece reaches the module that looks it up -----------------------------------


@pytest.mark.parametrize("module_name", runtime.HOST_POOL_MODULES)
def test_reference_ops_are_bound_in_every_host_pool_module(module_name: str) -> None:
    module = importlib.import_module(module_name)
    names = runtime.cuda_kvcacheio_names(module_name)
    assert "transfer_kv_direct" in names
    for name in names:
        assert getattr(module, name) is getattr(kvcacheio, name), f"{module_name}.{name}"


def test_a_missing_reference_op_is_named_at_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(kvcacheio, "transfer_kv_per_layer_mla")
    missing = "pool_host.dsa.transfer_kv_per_layer_mla"
    with pytest.raises(runtime.UpstreamLayoutChanged, match=missing):
        runtime.reference_op_table()


def test_controllers_and_transfers_use_the_cpu_device_module() -> None:
    for module_name in runtime.DEVICE_MODULE_HOLDERS:
        assert importlib.import_module(module_name).device_module is CPU_DEVICE_MODULE
    CPU_DEVICE_MODULE.Stream().synchronize()  # l2_transfer's error path calls it


def test_host_pools_are_pageable_and_reserve_no_host_memory() -> None:
    base = importlib.import_module(runtime.HOST_POOL_BASE)
    assert base.HICACHE_HOST_MEMORY_RESERVE_BYTES == 0
    assert isinstance(base.HostKVCache.pin_memory, property)


def test_sharded_pool_builds_the_gloo_communicator() -> None:
    pool_module = importlib.import_module(runtime.PAGE_INTERLEAVE_POOL)
    assert pool_module.PyNcclCommunicator is GlooGatherCommunicator
    assert pool_module.get_mla_kv_buffer_triton is get_mla_kv_buffer_reference
    index_module = importlib.import_module(runtime.DSA_INDEX_K_CACHE)
    assert index_module.SetKAndS.execute.__func__ is runtime.set_k_and_s_reference


# ---- the gather communicator at world size 1 ------------------------------------------


def test_communicator_of_one_rank_is_disabled_and_a_no_op(gloo_world1) -> None:
    comm = GlooGatherCommunicator(group=gloo_world1, device="cpu")
    assert (comm.world_size, comm.available, comm.disabled) == (1, False, True)
    out = torch.zeros(4, dtype=torch.bfloat16)
    comm.all_gather(out, torch.ones(4, dtype=torch.bfloat16))
    assert torch.count_nonzero(out) == 0


def test_communicator_enabled_gathers_its_own_block_in_place(gloo_world1) -> None:
    comm = GlooGatherCommunicator(group=gloo_world1, device="cpu")
    scratch = torch.zeros((3, 2), dtype=torch.bfloat16)
    scratch[:] = torch.arange(6, dtype=torch.bfloat16).view(3, 2)
    expected = scratch.clone()
    with comm.change_state(enable=True):
        assert not comm.disabled
        comm.all_gather(scratch, scratch[0:3])
    assert comm.disabled and torch.equal(scratch, expected)


def test_communicator_refuses_what_gloo_cannot_do(gloo_world1) -> None:
    with pytest.raises(ValueError, match="cta_policy"):
        GlooGatherCommunicator(group=gloo_world1, device="cpu", cta_policy=1)
    comm = GlooGatherCommunicator(group=gloo_world1, device="cpu")
    with comm.change_state(enable=True), pytest.raises(ValueError, match="expected 1 x 2"):
        comm.all_gather(torch.zeros(3), torch.zeros(2))


# ---- the Triton stand-ins --------------------------------------------------------------


class _IndexPool:
    index_page_size = 64


def test_indexer_store_reference_packs_keys_then_scales() -> None:
    ps, dim = 64, 128
    buf = torch.zeros((3, ps * (dim + 4)), dtype=torch.uint8)
    loc = torch.tensor([65, 130], dtype=torch.int64)  # page 1 slot 1, page 2 slot 2
    keys = torch.randint(0, 256, (2, dim), dtype=torch.uint8)
    scales = torch.tensor([[1.5], [-2.0]], dtype=torch.float32)
    runtime.set_k_and_s_reference(
        None, _IndexPool(), buf, loc, keys.view(torch.float8_e4m3fn), scales
    )
    for token, (page, slot) in enumerate([(1, 1), (2, 2)]):
        assert torch.equal(buf[page, slot * dim : (slot + 1) * dim], keys[token])
        scale_at = ps * dim + slot * 4
        assert buf[page, scale_at : scale_at + 4].view(torch.float32).item() == scales[token]
    assert int(buf.count_nonzero()) == int(keys.count_nonzero()) + int(
        scales.view(torch.uint8).count_nonzero()
    )
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        runtime.set_k_and_s_reference(None, _IndexPool(), buf, loc, keys, scales)


def test_mla_row_read_reference_splits_nope_and_rope() -> None:
    kv = torch.randn((5, 1, 576)).to(torch.bfloat16)
    loc = torch.tensor([4, 0, 2])
    nope = torch.empty((3, 1, 512), dtype=torch.bfloat16)
    rope = torch.empty((3, 1, 64), dtype=torch.bfloat16)
    get_mla_kv_buffer_reference(kv, loc, nope, rope)
    assert torch.equal(nope, kv[loc][..., :512]) and torch.equal(rope, kv[loc][..., 512:])


# ---- the JIT HiCache modules -------------------------------------------------------------


def test_jit_hicache_wrappers_run_over_the_stand_in_modules() -> None:
    module = importlib.import_module(runtime.HICACHE_JIT)
    assert module._jit_hicache_module is hicache_jit.register_module
    assert module._jit_hicache_tma_module is hicache_jit.tma_module
    # as an sm_90 part: bf16 and DSA FP8 latent rows, and indexer pages as items
    assert module.can_use_hicache_jit_kernel(element_size=1152, page_size=64)
    assert module.can_use_hicache_jit_kernel(element_size=656, page_size=64)
    assert module.can_use_hicache_jit_kernel(element_size=64 * 132, page_size=1)
    assert not module.can_use_hicache_jit_kernel(element_size=40, page_size=64)


def test_without_tma_the_dsa_fp8_latent_row_has_no_jit_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLANG_HICACHE_TMA_TRANSFER=0: the register kernel tiles 128-byte groups, 656 B does not
    module = importlib.import_module(runtime.HICACHE_JIT)
    monkeypatch.setenv("SGLANG_HICACHE_TMA_TRANSFER", "0")
    assert not module.use_hicache_tma_kernel(element_size=656, block_quota=4, page_size=64)
    assert not module.can_use_hicache_jit_kernel(element_size=656, page_size=64)
    assert module.can_use_hicache_jit_kernel(element_size=1152, page_size=64)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_host_pools_take_the_jit_branches_the_modelled_part_takes(gloo_world1, layout: str) -> None:
    """``can_use_jit`` as an sm_90 part computes it (upstream gates it on CUDA/ROCm first):
    bf16 latent rows of 1152 B have a JIT kernel, so the pool's transfers take its branches."""
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    with build_unsharded_stack(gloo_world1, StackConfig(device_pages_per_rank=8, mem_layout=layout)) as stack:
        assert stack.kv_host_pool.can_use_jit is True
        assert stack.kv_host_pool.can_use_write_back_jit is False  # the staged kernel has no stand-in


def test_one_layer_jit_backup_into_page_first_host_pools(gloo_world1) -> None:
    """Upstream's wrapper, as ``pool_host/mla.py`` calls it for a layer-sharded page_first
    backup (``cache_dst=self.data_refs[host_layer_id]``), and the same kernel over the DSA
    indexer host pool's per-layer view (pages as items, ``page_size=1``): exactly that
    layer's slots change, to the device bytes."""
    from sglang.kernels.ops.kvcache.hicache import transfer_hicache_one_layer_mla

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    config = StackConfig(device_pages_per_rank=8, mem_layout="page_first")
    with build_unsharded_stack(gloo_world1, config) as stack:
        kv_host, indexer_host = stack.kv_host_pool, stack.indexer_host_pool
        layers = config.layer_num
        assert kv_host.kv_buffer.shape == (kv_host.size, layers, 1, config.kv_cache_dim)
        pages = indexer_host.index_k_with_scale_buffer
        assert pages.shape == (indexer_host.indexer_page_num, layers, 1, 64 * 132)
        assert pages.dtype == torch.uint8
        generator = torch.Generator().manual_seed(11)
        kv_host.kv_buffer.view(torch.uint8).copy_(
            torch.randint(0, 256, kv_host.kv_buffer.view(torch.uint8).shape, generator=generator)
        )
        pages.copy_(torch.randint(0, 256, pages.shape, generator=generator))
        kv_before, pages_before = kv_host.kv_buffer.clone(), pages.clone()
        device_tokens = torch.cat([torch.arange(128, 192), torch.arange(64, 128)])
        host_tokens = torch.cat([torch.arange(256, 320), torch.arange(0, 64)])
        layer = 1
        device_kv = stack.kv_pool.kv_buffer[layer]
        device_kv.view(torch.uint8).copy_(torch.randint(0, 256, device_kv.view(torch.uint8).shape, generator=generator))
        transfer_hicache_one_layer_mla(
            cache_dst=kv_host.data_refs[layer], indices_dst=host_tokens,
            cache_src=device_kv, indices_src=device_tokens,
            element_dim=config.kv_cache_dim, page_size=config.page_size,
        )  # fmt: skip
        kv_before[host_tokens, layer] = device_kv[device_tokens]
        assert torch.equal(kv_host.kv_buffer.view(torch.uint8), kv_before.view(torch.uint8))

        device_pages = stack.kv_pool.index_k_with_scale_buffer[layer]
        device_pages.copy_(torch.randint(0, 256, device_pages.shape, generator=generator))
        host_page_idx, device_page_idx = host_tokens[::64] // 64, device_tokens[::64] // 64
        transfer_hicache_one_layer_mla(
            cache_dst=pages.transpose(0, 1)[layer], indices_dst=host_page_idx,
            cache_src=device_pages, indices_src=device_page_idx,
            element_dim=indexer_host.indexer_page_stride_size, page_size=1,
        )  # fmt: skip
        pages_before[host_page_idx, layer, 0] = device_pages[device_page_idx]
        assert torch.equal(pages, pages_before)


# ---- end to end: the real unsharded stack through the injected ops --------------------


def test_unsharded_stack_round_trips_kv_and_indexer_through_host(gloo_world1) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    with build_unsharded_stack(gloo_world1, StackConfig(device_pages_per_rank=8)) as stack:
        assert type(stack.kv_host_pool).__name__ == "MLATokenToKVPoolHost"
        tokens = list(range(1, 3 * 64 + 1))
        locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens))
        assert base is None
        generator = torch.Generator().manual_seed(7)
        page_rows = locs[::64] // 64
        latent, pages = [], []
        for layer in range(stack.config.layer_num):
            kv_buffer = stack.kv_pool.kv_buffer[layer]
            index_buffer = stack.kv_pool.index_k_with_scale_buffer[layer]
            latent.append(torch.randn(kv_buffer[locs].shape, generator=generator))
            pages.append(torch.randint(0, 256, index_buffer[page_rows].shape, generator=generator))
            latent[-1], pages[-1] = latent[-1].to(kv_buffer.dtype), pages[-1].to(torch.uint8)
            kv_buffer[locs], index_buffer[page_rows] = latent[-1], pages[-1]
        stack.insert(tokens, locs, base)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        stack.cache.evict(EvictParams(num_tokens=len(tokens)))
        for layer in range(stack.config.layer_num):
            stack.kv_pool.kv_buffer[layer].zero_()
            stack.kv_pool.index_k_with_scale_buffer[layer].zero_()
        match = stack.match(tokens)
        assert match.host_hit_length == len(tokens)
        assert stack.cache.load_back(match.best_match_node)
        stack.cache.ready_to_load_host_cache()
        stack.cache.loading_check()
        loaded = stack.cache.path_device_indices(stack.match(tokens).last_device_node)
        for layer in range(stack.config.layer_num):
            assert torch.equal(stack.kv_pool.kv_buffer[layer][loaded], latent[layer])
            index_buffer = stack.kv_pool.index_k_with_scale_buffer[layer]
            assert torch.equal(index_buffer[loaded[::64] // 64], pages[layer])
