"""A CPU stand-in for ``torch.cuda``'s stream/event surface used by SGLang's cache controllers.

Transfers on CPU run synchronously, so an event is complete once recorded. Tests that need
in-flight states (a backup whose ack has not arrived) hold events open with
:func:`CpuDeviceModule.hold_events`; held events report ``query() == False`` until released.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import ContextManager, Iterator, List, Optional


class CpuEvent:
    """Event whose completion a test can delay; otherwise complete when recorded.

    Timing follows CUDA's rule: :meth:`elapsed_time` needs both events created with
    ``enable_timing=True`` and recorded (SGLang's write-ack metrics read it)."""

    def __init__(self, module: "CpuDeviceModule", enable_timing: bool = False, **_: object):
        self._module = module
        self._recorded = False
        self._held = False
        self._timing = enable_timing
        self._recorded_at: Optional[float] = None

    def record(self, stream: Optional["CpuStream"] = None) -> None:
        self._recorded = True
        self._recorded_at = time.perf_counter()
        self._held = self._module._register_if_holding(self)

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds from this event's record to ``end``'s."""
        if not (self._timing and end._timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end._recorded_at - self._recorded_at) * 1000.0

    def query(self) -> bool:
        return not self._held

    def synchronize(self) -> None:
        if self._held:
            raise RuntimeError(
                "synchronize() on a held CPU event would deadlock: release the hold first"
            )

    def wait(self, stream: Optional["CpuStream"] = None) -> None:
        return None

    def _release(self) -> None:
        self._held = False


class CpuStream:
    """No-op stream: CPU work is ordered by program order."""

    def __init__(self, *_, **__):
        pass

    def wait_event(self, event: CpuEvent) -> None:
        return None

    def wait_stream(self, stream: "CpuStream") -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuDeviceModule:
    """Module-like object exposing ``Event``, ``Stream``, ``stream``, ``current_stream``.

    The current stream is per thread, as CUDA's is: :attr:`default_stream` (the legacy
    default stream) unless a ``stream(...)`` block on this thread names another, so the
    CPU runtime can refuse what CUDA refuses on the default stream (see
    ``kvcacheio.require_side_stream``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: List["_EventHold"] = []  # open holds, oldest first
        self.default_stream = CpuStream()
        self._thread = threading.local()

    def Event(self, *args, **kwargs) -> CpuEvent:  # noqa: N802 - mirrors torch API
        return CpuEvent(self, *args, **kwargs)

    def Stream(self, *args, **kwargs) -> CpuStream:  # noqa: N802 - mirrors torch API
        return CpuStream(*args, **kwargs)

    @contextlib.contextmanager
    def stream(self, stream: Optional[CpuStream]) -> Iterator[None]:
        if stream is None:  # torch.cuda.stream(None) is a no-op
            yield
            return
        previous = self.current_stream()
        self._thread.current = stream
        try:
            yield
        finally:
            self._thread.current = previous

    def current_stream(self, device: object = None) -> CpuStream:
        return getattr(self._thread, "current", self.default_stream)

    def synchronize(self, device: object = None) -> None:
        return None

    def is_available(self) -> bool:
        return False

    def __getattr__(self, name: str):
        # Anything beyond streams/events behaves like torch.cpu.
        import torch

        return getattr(torch.cpu, name)

    def _register_if_holding(self, event: CpuEvent) -> bool:
        with self._lock:
            if self._holds:
                self._holds[-1]._events.append(event)  # the newest hold captures it
                return True
            return False

    def hold_events(self) -> "_EventHold":
        """Events recorded until ``release()`` (or until a newer hold opens) stay incomplete
        (in-flight transfers); each hold releases only the events it captured, so transfers
        of different steps can land at different times."""
        hold = _EventHold(self)
        with self._lock:
            self._holds.append(hold)
        return hold


class _EventHold:
    def __init__(self, module: CpuDeviceModule) -> None:
        self._module = module
        self._events: List[CpuEvent] = []
        self._released = False

    def seal(self) -> None:
        """Capture no further events; those captured stay held until ``release()``."""
        with self._module._lock:
            if self in self._module._holds:
                self._module._holds.remove(self)

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.seal()
        with self._module._lock:
            events, self._events = self._events, []
        for event in events:
            event._release()

    def __enter__(self) -> "_EventHold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


CPU_DEVICE_MODULE = CpuDeviceModule()


def on_side_stream() -> ContextManager[None]:
    """A fresh side stream made current on this thread, as the cache controller makes its
    write/load streams current around a transfer (what a test calling host-pool transfers
    directly must do, or the page-first direct ops refuse the default stream)."""
    return CPU_DEVICE_MODULE.stream(CPU_DEVICE_MODULE.Stream())
