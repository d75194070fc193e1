"""How far a per-layer D2H backup overlaps its forward on CUDA (both lines' round trips):
CUDA events after layer 0's copy and after the last layer's stores; nothing on CPU, where
copies are synchronous."""

from __future__ import annotations

from typing import Any, Optional

import torch


class ForwardTiming:
    """CUDA events around one forward; every call is a no-op on a CPU device."""

    def __init__(self, device: str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._layer0_copied: Optional[Any] = None
        self._last_stored: Optional[Any] = None

    def stall(self, cycles: int) -> None:
        """Hold the forward's stream for ``cycles`` GPU cycles (a slow layer)."""
        if self.cuda and cycles:
            torch.cuda._sleep(cycles)

    def layer0_copied(self, write_stream: Any) -> None:
        if self.cuda:
            self._layer0_copied = torch.cuda.Event(enable_timing=True)
            self._layer0_copied.record(write_stream)

    def last_layer_stored(self) -> None:
        if self.cuda:
            self._last_stored = torch.cuda.Event(enable_timing=True)
            self._last_stored.record()

    def overlap_ms(self) -> Optional[float]:
        """Milliseconds from layer 0's copy done to the last layer's stores done (> 0: the
        copy finished while the forward was still computing); None on CPU."""
        if self._layer0_copied is None or self._last_stored is None:
            return None
        torch.cuda.synchronize()
        return float(self._layer0_copied.elapsed_time(self._last_stored))


__all__ = ["ForwardTiming"]
