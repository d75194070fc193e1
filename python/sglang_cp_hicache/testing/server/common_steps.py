"""CPU server runtime steps both SGLang lines take alike (test-only; each line's
``server_runtime.steps()`` lists them among its own)."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Tuple

from sglang_cp_hicache.core.import_watcher import process_watcher

HOPPER_CAPABILITY = (9, 0)
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
ROPE_VARIANT = "sglang.srt.layers.rotary_embedding.rope_variant"


def set_environment(values: Dict[str, str]) -> Callable[[], None]:
    """A step that sets SGLang's own knobs before SGLang is imported."""
    return lambda: os.environ.update(values)


def hopper_capability() -> None:
    """``torch.cuda.get_device_capability`` reports an H200 (what the plugin's admission
    and SGLang's SM checks read)."""
    import torch

    torch.cuda.get_device_capability = lambda *args, **kwargs: HOPPER_CAPABILITY


def cuda_streams_on_cpu() -> None:
    """``torch.cuda`` streams, events and synchronize on the project's CPU device module."""
    import torch

    from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE, CpuEvent

    class CudaEventOnCpu(CpuEvent):
        """``torch.cuda.Event`` on the CPU device module (a class: SGLang annotates with it)."""

        def __init__(self, enable_timing: bool = False, **_kwargs: Any):
            super().__init__(CPU_DEVICE_MODULE, enable_timing=enable_timing)

    torch.cuda.current_stream = CPU_DEVICE_MODULE.current_stream
    torch.cuda.stream = CPU_DEVICE_MODULE.stream
    torch.cuda.synchronize = CPU_DEVICE_MODULE.synchronize
    torch.cuda.Event = CudaEventOnCpu


def gloo_groups() -> None:
    """Model-parallel groups without pynccl (``PyNcclCommunicator`` needs a CUDA device):
    their collectives run on the groups' gloo device groups."""

    def patch(module: Any) -> None:
        original = module.init_model_parallel_group

        def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
            kwargs["use_pynccl"] = False
            return original(*args, **kwargs)

        module.init_model_parallel_group = init_model_parallel_group

    process_watcher().when_imported(PARALLEL_STATE, patch)


def deepseek_rope_forward_native(rotate_neox: Callable, rotate_gptj: Callable) -> Callable:
    """``DeepseekScalingRotaryEmbedding.forward_native`` for 1-D positions and heads either
    explicit (``[n, H, head_size]``) or flattened (``[n, H * head_size]``, ``[n, head_size]``).

    Upstream's neox branch (both lines) repeats a 2-D cos/sin row with ``repeat(1, 1, 2)``,
    which adds a leading dimension, so every neox query comes back ``[1, n, H, d]`` and a key
    without a head dimension broadcasts against the positions; GPUs never run it."""

    def forward_native(self: Any, positions: Any, query: Any, key: Any, offsets: Any = None) -> Tuple[Any, Any]:
        import torch

        index = torch.add(positions, offsets) if offsets is not None else positions
        cos, sin = self.cos_sin_cache[index].chunk(2, dim=-1)
        if self.is_neox_style:
            cos, sin, rotate = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1), rotate_neox
        else:
            cos, sin, rotate = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), rotate_gptj
        cos, sin = cos[:, None, :], sin[:, None, :]

        def apply(x: Any) -> Any:
            shape, dtype = x.shape, x.dtype
            heads = x.reshape(shape[0], -1, self.head_size)
            rot = heads[..., : self.rotary_dim]
            rot = rot * cos + rotate(rot) * sin
            return torch.cat([rot.to(dtype), heads[..., self.rotary_dim :]], -1).reshape(shape)

        return apply(query), apply(key)

    return forward_native


def fixed_rope() -> None:
    """Upstream's ``DeepseekScalingRotaryEmbedding.forward_native`` replaced by
    :func:`deepseek_rope_forward_native` over the module's own rotations (both lines'
    ``rope_variant`` import ``rotate_neox`` / ``rotate_gptj``)."""

    def patch(module: Any) -> None:
        module.DeepseekScalingRotaryEmbedding.forward_native = deepseek_rope_forward_native(
            module.rotate_neox, module.rotate_gptj
        )

    process_watcher().when_imported(ROPE_VARIANT, patch)


__all__ = [
    "HOPPER_CAPABILITY",
    "cuda_streams_on_cpu",
    "deepseek_rope_forward_native",
    "fixed_rope",
    "gloo_groups",
    "hopper_capability",
    "set_environment",
]
