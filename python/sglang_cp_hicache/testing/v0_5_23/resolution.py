"""Launch commands through SGLang 0.5.23's real resolution pipeline on the CPU.

The argv pieces the plugin's resolution tests share (a DSA PD prefill with interleave
prefill CP, HiCache), a tiny local GLM-5 ``config.json`` for them to resolve against, and
the resolution itself (``prepare_server_args`` then ``resolve_once``, as the launcher runs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Union

PD_PREFILL_CP: List[str] = [
    "--enable-prefill-cp", "--cp-strategy", "interleave", "--disaggregation-mode", "prefill",
    "--disaggregation-transfer-backend", "mooncake", "--attention-backend", "dsa",
]  # fmt: skip
HICACHE: List[str] = ["--enable-hierarchical-cache", "--hicache-size", "1"]


def write_tiny_glm5(path: Union[str, Path]) -> str:
    """A two-layer GLM-5 ``config.json`` (with one MTP layer) in ``path``; returns ``path``."""
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    GlmMoeDsaConfig(
        num_hidden_layers=2, architectures=["GlmMoeDsaForCausalLM"], num_nextn_predict_layers=1
    ).save_pretrained(path)
    return str(path)


def resolve(argv: List[str]) -> Any:
    """The record of ``argv``, resolved once (every resolution step and gate run)."""
    from sglang.srt.server_args import prepare_server_args

    record = prepare_server_args(argv)
    record.resolve_once()
    return record
