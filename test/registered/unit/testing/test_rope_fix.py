"""The CPU server runtime's fix of upstream's ``DeepseekScalingRotaryEmbedding.forward_native``
(both lines: ``testing/server/common_steps.py``), against the rotation written out, with the
upstream bug pinned. Runs in both venvs."""

from __future__ import annotations

import torch
from sglang.srt.layers.rotary_embedding import rope_variant

from sglang_cp_hicache.testing.server.common_steps import deepseek_rope_forward_native

FIXED = deepseek_rope_forward_native(rope_variant.rotate_neox, rope_variant.rotate_gptj)


def _rope():
    """Upstream's class with only what ``forward_native`` reads (its constructor picks a
    kernel by device, importing vLLM off the CPU engine)."""
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    rope = DeepseekScalingRotaryEmbedding.__new__(DeepseekScalingRotaryEmbedding)
    torch.nn.Module.__init__(rope)
    rope.head_size = rope.rotary_dim = 64
    rope.is_neox_style = True
    angles = torch.arange(256, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
    rope.cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    return rope


def _rotated(rope, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Neox rotation written out: pairs (i, i + d/2) turned by each position's angles."""
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    first, second = x[..., :32], x[..., 32:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def test_upstream_forward_native_adds_a_dimension_on_cpu():
    """Pins upstream's bug (0.5.12.post1 and 0.5.23): with 1-D positions its neox branch repeats a 2-D cos row
    into 3-D, so a ``[n, H, d]`` query comes back ``[1, n, H, d]``."""
    rope = _rope()
    positions = torch.arange(5)
    query, key = torch.randn(5, 4, 64), torch.randn(5, 1, 64)
    got_query, _ = rope.forward_native(positions, query, key)
    assert got_query.shape != query.shape


def test_fixed_forward_native_rotates_explicit_and_flattened_heads():
    rope = _rope()
    positions = torch.tensor([0, 3, 7, 100])
    query, key = torch.randn(4, 4, 64), torch.randn(4, 64)  # the indexer's key has no head dim
    got_query, got_key = FIXED(rope, positions, query, key)
    torch.testing.assert_close(got_query, _rotated(rope, positions, query))
    torch.testing.assert_close(got_key, _rotated(rope, positions, key[:, None, :])[:, 0])
    flat_query, _ = FIXED(rope, positions, query.reshape(4, -1), key)
    torch.testing.assert_close(flat_query, got_query.reshape(4, -1))
