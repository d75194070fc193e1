"""One module's global binding of a name, swapped for a block (imports no SGLang).

The hook registry patches a function where it is defined, so every module that imported
it sees the patch. Some deltas must change what one caller reads and nothing else (the
gate's view of a record, the attach's sharding check): they swap that caller module's own
binding of the name for the block, on the thread that runs it, and restore it on exit,
raising or not."""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Callable, Iterator


@contextmanager
def binding_swapped(
    module: ModuleType, name: str, replacement: Callable[[Callable], Callable]
) -> Iterator[None]:
    """Within: ``module.<name>`` is ``replacement(original)``; the original afterwards."""
    original = getattr(module, name)
    setattr(module, name, replacement(original))
    try:
        yield
    finally:
        setattr(module, name, original)


__all__ = ["binding_swapped"]
