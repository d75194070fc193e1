"""The runtime context a read-path rank publishes as a server would: server args, the DSA
model config, the CP and attention groups."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatchSpec
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import DsaKvFormat, FLASHMLA_SPARSE_BF16
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup


# ------------------------------------------------------------------- runtime context
def _dsa_model_config(config: SparseMLAConfig, context_len: int) -> Any:
    """A real ``ModelConfig`` of a tiny GLM-5 (``GlmMoeDsaForCausalLM``) geometry."""
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import GlmMoeDsaConfig

    hf_config = GlmMoeDsaConfig(
        vocab_size=128,
        hidden_size=config.hidden_size,
        intermediate_size=config.hidden_size,
        moe_intermediate_size=config.hidden_size // 2,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.hidden_size,
        qk_rope_head_dim=config.qk_rope_head_dim,
        qk_nope_head_dim=config.kv_lora_rank,
        v_head_dim=config.kv_lora_rank,
        index_topk=config.index_topk,
        index_head_dim=config.index_head_dim,
        index_n_heads=config.index_n_heads,
        max_position_embeddings=context_len,
        first_k_dense_replace=config.num_layers,
    )
    hf_config.architectures = ["GlmMoeDsaForCausalLM"]
    with tempfile.TemporaryDirectory(prefix="read-path-model-") as path:
        hf_config.save_pretrained(path)
        return ModelConfig(model_path=path, context_length=context_len)


def publish_runtime_context(
    config: SparseMLAConfig,
    spec: ReadPathBatchSpec,
    shard_group: GlooShardGroup,
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16,
) -> Any:
    """Publish this rank's config the way the backend and CP strategy read it: a DSA model,
    ``kv_format``'s prefill and decode backends, torch top-k (target and MTP draft), prefill
    CP interleave over the shard group (``attn_cp_size`` = ``tp_size`` = shard size, as
    ``kv_shard_hook`` requires)."""
    from sglang.srt.runtime_context import get_context, get_parallel, get_server_args
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            page_size=config.page_size,
            context_length=spec.context_len,
            chunked_prefill_size=spec.chunked_prefill_size,
        )
    )
    # A ModelConfig supplied on the record is used as is (model_override_base.py:200-211).
    get_server_args()._model_config = model_config = _dsa_model_config(config, spec.context_len)
    get_context().override(
        "read_path",
        dsa_prefill_backend=kv_format.prefill_backend,
        dsa_decode_backend=kv_format.decode_backend,
        dsa_topk_backend="torch",
        speculative_dsa_topk_backend="torch",  # what the MTP draft's backend reads
    )
    size = shard_group.world_size
    get_parallel().override_permanently(
        tp_size=size,
        moe_tp_size=size,
        attn_cp_size=size,
        attn_cp_rank=shard_group.rank_in_group,
        attn_cp_group=shard_group,
        enable_prefill_cp=True,
        cp_strategy="interleave",
    )
    return model_config
