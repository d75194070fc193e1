"""Planted faults shared by both lines' prepared checks (``scripts/gpu/device_check.py``):
each must make its check fail, or the check cannot fail."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


class EventWithoutWait:
    """A layer-stored event whose ``wait`` does nothing: the write stream no longer waits
    for the layer's stores (on CUDA, with the forward's stream stalled, it copies the bytes
    from before them)."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self, stream: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


@contextlib.contextmanager
def patched(owner: type, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` for the block, restored after it."""
    original = owner.__dict__[name]
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def events_without_wait(owner: type, method: str = "new_event") -> Any:
    """The planted missing wait: every event ``owner.method`` makes ignores ``wait``."""
    return patched(owner, method, lambda new_event: lambda self: EventWithoutWait(new_event(self)))


__all__ = ["EventWithoutWait", "events_without_wait", "patched"]
