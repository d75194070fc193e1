"""The scratch figure equals what upstream 0.5.23 charges: row bytes against
``_page_shard_row_bytes`` on a real GLM-5 ``ModelConfig``, rows against ``PageShardSpec``."""

from types import SimpleNamespace

import pytest

from sglang_cp_hicache.v0_5_23.selftest.kv_shard_scratch import DsaScratchGeometry, dsa_scratch_figure


@pytest.fixture(scope="module")
def glm5_model_config(tmp_path_factory):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import restore_context, snapshot_context
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    path = tmp_path_factory.mktemp("glm5")
    GlmMoeDsaConfig(num_hidden_layers=2, architectures=["GlmMoeDsaForCausalLM"]).save_pretrained(path)
    before = snapshot_context()
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))  # ModelConfig reads it
    try:
        yield ModelConfig(model_path=str(path))
    finally:
        restore_context(before)


@pytest.mark.parametrize("dtype, torch_dtype", [("bfloat16", "bfloat16"), ("fp8_e4m3", "float8_e4m3fn")])
def test_row_bytes_are_upstreams(glm5_model_config, dtype, torch_dtype):
    import torch
    from sglang.srt.mem_cache.page_interleave import _page_shard_row_bytes

    hf = glm5_model_config.hf_config
    geometry = DsaScratchGeometry(hf.kv_lora_rank, hf.qk_rope_head_dim, hf.index_head_dim)
    kvc = SimpleNamespace(  # the three fields _page_shard_row_bytes reads
        model_config=glm5_model_config, kv_cache_dtype=getattr(torch, torch_dtype), use_mla_backend=True
    )
    assert geometry.row_bytes(dtype) == _page_shard_row_bytes(kvc)


def test_glm5_128k_figures():
    bf16 = dsa_scratch_figure(kv_cache_dtype="bfloat16", context_len=131072, chunked_prefill_size=8192, shard_size=8)
    fp8 = dsa_scratch_figure(kv_cache_dtype="fp8_e4m3", context_len=131072, chunked_prefill_size=8192, shard_size=8)
    assert bf16.rows_per_slot == 8 * 131072 + 8192 + 64  # 128K is a multiple of the cp-8 span
    assert (bf16.row_bytes, fp8.row_bytes) == (1284, 788)
    assert round(bf16.gib, 2) == 2.53 and round(fp8.gib, 2) == 1.55
    with_mtp = dsa_scratch_figure(
        kv_cache_dtype="fp8_e4m3", context_len=131072, chunked_prefill_size=8192, shard_size=8, with_mtp=True
    )
    assert with_mtp.bytes == 2 * fp8.bytes and "MTP" in with_mtp.line()
