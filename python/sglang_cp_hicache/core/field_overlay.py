"""The one way the plugin shows SGLang code an object with a few fields changed (imports
no SGLang).

Some deltas must let upstream's own code decide over a record or runner that differs from
the real one in a named field or two, and in nothing else: upstream's sharding gate shown
the resolved record with its admitted Hopper backend triple as upstream's own triple, or
without an admitted L3 backend; the startup refusal of a runtime attach, computed for the
record as if launched with that backend; upstream's DSA backend built over the self-test's
pools instead of the server's. A :class:`FieldOverlay` reads every other attribute from the
real object at the moment it is read (a later resolution step's value shows through), and
it is read-only, so upstream's code cannot write into a view and lose the write.

Where the change must reach one caller module's *global* name instead of an argument (the
gate's ``resolving_view``, the attach module's sharding check), the view is handed over by
:func:`sglang_cp_hicache.core.module_binding.binding_swapped`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping


class FieldOverlay:
    """``base`` seen through: each name in ``shown`` reads ``shown[name](base's value)``
    (None where the base has no such field: a view may add one); every other attribute is
    the base's, read live. Writes raise ``AttributeError``."""

    __slots__ = ("_base", "_shown")

    def __init__(self, base: Any, shown: Mapping[str, Callable[[Any], Any]]):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_shown", dict(shown))

    def __getattr__(self, name: str) -> Any:
        base = object.__getattribute__(self, "_base")
        show = object.__getattribute__(self, "_shown").get(name)
        if show is None:
            return getattr(base, name)
        return show(getattr(base, name, None))

    def __setattr__(self, name: str, value: Any) -> None:
        base = object.__getattribute__(self, "_base")
        raise AttributeError(f"a FieldOverlay of {type(base).__name__} is read-only (set {name!r})")


def constant(value: Any) -> Callable[[Any], Any]:
    """A field shown as ``value`` whatever the base holds."""
    return lambda _real: value


__all__ = ["FieldOverlay", "constant"]
