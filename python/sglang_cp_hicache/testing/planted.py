"""Planted faults shared by both lines' prepared checks (``scripts/gpu/device_check.py``)
and tests: each must make its check fail, or the check cannot fail. Also the call counter
a test uses to show the path it checks really ran."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Sequence


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


def events_without_wait(owner: type) -> Any:
    """The planted missing wait: every event ``owner.new_event`` makes ignores ``wait``."""
    return patched(owner, "new_event", lambda new_event: lambda self: EventWithoutWait(new_event(self)))


@contextlib.contextmanager
def counted_calls(module: Any, names: Sequence[str], counts: Dict[str, int]) -> Iterator[None]:
    """For the block, every call of ``module``'s ``names`` adds one to ``counts[name]``
    and runs the original; restored after it."""
    originals = {name: getattr(module, name) for name in names}

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(module, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


__all__ = ["EventWithoutWait", "counted_calls", "events_without_wait", "patched"]
