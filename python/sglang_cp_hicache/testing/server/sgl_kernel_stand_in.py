"""A stand-in ``sgl_kernel`` for SGLang servers on a CPU without Intel AMX (test-only).

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports names from ``sgl_kernel`` at module
level, but with no AMX it calls only a few of them: attention falls back to ``torch_native``,
sampling to ``pytorch``, rope, norm and activations to their native paths. The stand-in
gives a torch body to each name a CPU server calls (:data:`TORCH_BODIES`) and, for every
other name a server imports (``imported``, per line), a function that raises naming the op
when called. Any name outside both is missing, as from a real package without it, so
SGLang's guarded imports keep their own fallbacks.
"""

from __future__ import annotations

import sys
import types
from typing import Callable, Dict, Iterable, Optional

import torch

STAND_IN_MARK = "__cp_hicache_stand_in__"


class StandInOpNotImplemented(NotImplementedError):
    """A server called an ``sgl_kernel`` op the CPU stand-in has no body for."""


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    _batch_size: int,
) -> None:
    """``req_to_token[req, start:end] = out_cache_loc[...]`` for each request, in order."""
    taken = 0
    for row in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[row]), int(end_offset[row])
        req_to_token[int(req_pool_indices[row]), start:end] = out_cache_loc[
            taken : taken + end - start
        ].to(req_to_token.dtype)
        taken += end - start


def _gated(activation: Callable[[torch.Tensor], torch.Tensor]):
    def op(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        half = x.shape[-1] // 2
        result = activation(x[..., :half]) * x[..., half:]
        if out is None:
            return result
        out.copy_(result)
        return out

    return op


TORCH_BODIES: Dict[str, Callable] = {
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "silu_and_mul": _gated(torch.nn.functional.silu),
    "gelu_and_mul": _gated(torch.nn.functional.gelu),
    "gelu_tanh_and_mul": _gated(lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
}


def _not_implemented(name: str) -> Callable:
    def op(*args, **kwargs):
        raise StandInOpNotImplemented(
            f"sgl_kernel.{name} was called, but the CPU server runtime's sgl_kernel stand-in "
            "has no torch body for it (add one to testing/server/sgl_kernel_stand_in.py)"
        )

    op.__name__ = name
    return op


def stand_in_module(imported: Iterable[str], into: Optional[types.ModuleType] = None) -> types.ModuleType:
    """The ``sgl_kernel`` module: :data:`TORCH_BODIES` plus a raising op per name of
    ``imported`` without a body. ``into``: add the names to an existing stand-in package
    (the 0.5.12 CPU runtime's, which holds ``kvcacheio``) instead of a new one."""
    module = into if into is not None else types.ModuleType("sgl_kernel")
    if into is None:
        module.__path__ = []  # a package: ``import sgl_kernel.x`` fails as for a missing x
        setattr(module, STAND_IN_MARK, True)
    for name in imported:
        if name not in TORCH_BODIES and not hasattr(module, name):
            setattr(module, name, _not_implemented(name))
    for name, body in TORCH_BODIES.items():
        setattr(module, name, body)
    return module


def install(imported: Iterable[str]) -> types.ModuleType:
    """Register the stand-in as ``sgl_kernel`` (extending one already registered)."""
    existing = sys.modules.get("sgl_kernel")
    if existing is not None and not getattr(existing, STAND_IN_MARK, False):
        raise RuntimeError("a real sgl_kernel is imported: the CPU stand-in would shadow it")
    module = stand_in_module(imported, into=existing)
    sys.modules["sgl_kernel"] = module
    return module


def add_bodies(bodies: Dict[str, Callable]) -> types.ModuleType:
    """Give the installed stand-in a torch body for each name of ``bodies`` (a line's own
    ops beyond :data:`TORCH_BODIES`, e.g. EAGLE's); raises unless the stand-in is installed."""
    module = sys.modules.get("sgl_kernel")
    if module is None or not getattr(module, STAND_IN_MARK, False):
        raise RuntimeError("the sgl_kernel stand-in is not installed: no module to give bodies to")
    for name, body in bodies.items():
        setattr(module, name, body)
    return module


__all__ = ["StandInOpNotImplemented", "TORCH_BODIES", "add_bodies", "install", "stand_in_module"]
