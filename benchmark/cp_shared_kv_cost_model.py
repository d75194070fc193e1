"""Arithmetic cost model of CP shared-KV prefix materialisation (no GPU, no ranks).

Per prefill forward and rank: bytes each strategy moves for the cached prefix (every
layer), the NVLink time that takes, and the compute time of the chunk the same layer
does, side by side. Materialisation of layer ``L + 1`` runs while layer ``L`` computes
(prefetch on a side stream, own communicator), so it hides when its per-layer time is
below the per-layer compute time.

The model constants are stated and printed: they are estimates, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_collectives import bytes_per_rank


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a DSA model (from its HF config)."""

    name: str
    num_layers: int
    active_params: float  # parameters touched per token (MoE active), all layers
    num_heads: int
    index_heads: int
    index_topk: int = 2048
    kv_lora_rank: int = 512
    rope_dim: int = 64
    index_head_dim: int = 128

    def kv_bytes_per_token(self, fp8: bool) -> int:
        """Per layer: MLA latent row (fp8: 656 B; bf16: 576 x 2) + index K/scale (132 B)."""
        latent = 656 if fp8 else 2 * (self.kv_lora_rank + self.rope_dim)
        return latent + self.index_head_dim + 4


MODELS: Dict[str, ModelShape] = {
    # GLM-5 (zai-org/GLM-5 config.json): 78 layers, 64 heads, DSA indexer 32 x 128, ~40B active.
    "glm5": ModelShape("GLM-5", num_layers=78, active_params=40e9, num_heads=64, index_heads=32),
    # DeepSeek-V3.2: 61 layers, 128 heads, indexer 64 x 128, ~37B active.
    "deepseek-v32": ModelShape("DeepSeek-V3.2", num_layers=61, active_params=37e9, num_heads=128, index_heads=64),
}


@dataclass(frozen=True)
class Hardware:
    """H200 NVLink 4 and Hopper tensor cores, at achievable (not peak) rates."""

    nvlink_bus_gbps: float = 360.0  # NCCL bus bandwidth per GPU, GB/s (450 GB/s link)
    tflops_bf16: float = 989.0
    tflops_fp8: float = 1979.0
    mfu: float = 0.5


@dataclass(frozen=True)
class CostRow:
    strategy: str
    bytes_per_layer: int
    bytes_per_forward: int
    comm_ms_per_layer: float
    compute_ms_per_layer: float

    @property
    def hidden(self) -> bool:
        return self.comm_ms_per_layer <= self.compute_ms_per_layer


def chunk_compute_ms_per_layer(model: ModelShape, prefix: int, chunk: int, cp: int, hw: Hardware) -> float:
    """One rank's compute for one layer of a ``chunk``-token extend after ``prefix`` cached
    tokens (the rank computes ``chunk / cp`` query tokens): dense/MoE matmuls at fp8, the
    indexer over every key at fp8, sparse MLA over ``topk`` keys at bf16."""
    tokens = chunk / cp
    mlp_flops = 2 * model.active_params / model.num_layers * tokens
    keys = prefix + chunk / 2  # causal average
    indexer_flops = 2 * model.index_heads * model.index_head_dim * keys * tokens
    attended = min(model.index_topk, keys)
    attn_flops = 2 * model.num_heads * (model.kv_lora_rank + model.rope_dim + model.kv_lora_rank) * attended * tokens
    fp8_s = (mlp_flops + indexer_flops) / (hw.tflops_fp8 * 1e12 * hw.mfu)
    bf16_s = attn_flops / (hw.tflops_bf16 * 1e12 * hw.mfu)
    return (fp8_s + bf16_s) * 1e3


def cost_rows(model: ModelShape, prefix: int, chunk: int, cp: int, fp8: bool, hw: Hardware = Hardware()) -> List[CostRow]:
    prefix_bytes = prefix * model.kv_bytes_per_token(fp8)
    compute_ms = chunk_compute_ms_per_layer(model, prefix, chunk, cp, hw)
    rows = []
    for strategy in ("all_gather", "all_reduce"):
        per_layer = bytes_per_rank(strategy, prefix_bytes, cp)
        rows.append(
            CostRow(
                strategy=strategy,
                bytes_per_layer=per_layer,
                bytes_per_forward=per_layer * model.num_layers,
                comm_ms_per_layer=per_layer / (hw.nvlink_bus_gbps * 1e9) * 1e3,
                compute_ms_per_layer=compute_ms,
            )
        )
    return rows


def break_even_chunk(model: ModelShape, prefix: int, cp: int, fp8: bool, strategy: str, hw: Hardware = Hardware()) -> int:
    """Smallest chunk (tokens, multiple of 256) whose per-layer compute hides the strategy."""
    chunk = 256
    while chunk < 1 << 22:
        row = next(r for r in cost_rows(model, prefix, chunk, cp, fp8, hw) if r.strategy == strategy)
        if row.hidden:
            return chunk
        chunk += 256
    return -1


def report(model_key: str, prefix: int, chunk: int, cp: int, fp8: bool, hw: Hardware = Hardware()) -> List[str]:
    model = MODELS[model_key]
    lines = [
        f"{model.name}: {model.num_layers} layers, {model.active_params / 1e9:.0f}B active, "
        f"{model.kv_bytes_per_token(fp8)} B/token/layer ({'fp8' if fp8 else 'bf16'} KV + index K); "
        f"prefix {prefix}, chunk {chunk}, cp {cp}",
        f"assumed: NVLink bus {hw.nvlink_bus_gbps:.0f} GB/s per GPU, {hw.tflops_fp8:.0f}/{hw.tflops_bf16:.0f} "
        f"TFLOPS fp8/bf16 at {hw.mfu:.0%} MFU",
        f"{'strategy':>11} {'MB/layer/rank':>14} {'GB/forward/rank':>16} {'NVLink ms/layer':>16} "
        f"{'chunk compute ms/layer':>23} {'hidden':>7}",
    ]
    for row in cost_rows(model, prefix, chunk, cp, fp8, hw):
        lines.append(
            f"{row.strategy:>11} {row.bytes_per_layer / 1e6:>14.1f} {row.bytes_per_forward / 1e9:>16.2f} "
            f"{row.comm_ms_per_layer:>16.3f} {row.compute_ms_per_layer:>23.3f} {'yes' if row.hidden else 'no':>7}"
        )
    for strategy in ("all_gather", "all_reduce"):
        lines.append(
            f"break-even chunk for {strategy}: {break_even_chunk(model, prefix, cp, fp8, strategy, hw)} tokens"
        )
    return lines
