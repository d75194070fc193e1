"""CPU stand-in for GPU-resident tensors that notices every read back to the host.

On a GPU, ``.cpu()``, ``.tolist()``, ``.item()``, ``.numpy()`` or ``bool()``/``int()`` of a
device tensor waits for the device stream: a device->host sync. On the CPU runtime every
tensor is already a host tensor, so such a read costs nothing and goes unnoticed.
:class:`DeviceOnly` marks the tensors a real forward batch keeps on the GPU
(``req_to_token``, ``req_pool_indices``, ``out_cache_loc``, the page tables; SGLang's
``*_cpu`` fields stay plain), keeps the mark through every torch op, and refuses a host
read with :class:`HostRead`, or, inside :func:`recording_host_reads`, records which
function made it.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Iterator, List, Optional

import torch

_HOST_READS = frozenset(
    {
        torch.Tensor.cpu,
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.__array__,
    }
)
_recorded: Optional[List[str]] = None


class HostRead(RuntimeError):
    """A device tensor was read on the host (a device->host sync on a GPU)."""


def _reader() -> str:
    """``module:function`` of the innermost caller outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith("/testing/host_reads.py"):
            continue
        module = path.rsplit("/python/", 1)[-1].removesuffix(".py").replace("/", ".")
        return f"{module}:{frame.name}"
    return "<unknown>"


def _reads_host(func, args, kwargs) -> bool:
    if func in _HOST_READS:
        return True
    if func is torch.Tensor.to:  # .to("cpu") / .to(device=cpu) is a copy back
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu" for t in targets)
    return False


class DeviceOnly(torch.Tensor):
    """A tensor standing for one that lives on the GPU (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _reads_host(func, args, kwargs):
            return super().__torch_function__(func, types, args, kwargs)
        reader = _reader()
        if _recorded is None:
            raise HostRead(f"{reader} read a device tensor on the host ({func.__name__})")
        _recorded.append(reader)
        result = super().__torch_function__(func, types, args, kwargs)
        # What comes back to the host is a host tensor: reading it again is free.
        return result.as_subclass(torch.Tensor) if isinstance(result, DeviceOnly) else result


def device_only(tensor: torch.Tensor) -> DeviceOnly:
    return tensor.as_subclass(DeviceOnly)


@contextlib.contextmanager
def recording_host_reads() -> Iterator[List[str]]:
    """Within the block, host reads of :class:`DeviceOnly` tensors are recorded (the
    reading ``module:function``, once per read) instead of raised."""
    global _recorded
    saved, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = saved
