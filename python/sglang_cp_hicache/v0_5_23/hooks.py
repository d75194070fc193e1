"""The 0.5.23 line's hook table: every hook and resolution step the plugin puts into
SGLang 0.5.23, joined from the rooms that own them.

Each room exports its seams by path (importing a room's package imports none of its
modules): ``launch`` (the flag, the mode, the DSA backend rule, PD bootstrap; and the
resolution steps), ``cache`` (one extension per sharded cache), ``eviction`` (lane-aware
device and host room), ``selftest`` (the startup self-test), ``storage`` (L3 owner I/O and
backends), ``backup`` (per-layer D2H) and ``admission`` (requests refused under the flag).
Two kinds of seams:

* :data:`HOOKS`, ``HookRegistry`` hooks (``module:qualname`` targets), handed over by
  :mod:`sglang_cp_hicache.hook_table`;
* :data:`RESOLUTION_STEPS`, wrappers of named steps of SGLang's resolution pipeline
  (:mod:`.resolution_steps`): 0.5.23 resolves server args there, not in
  ``ServerArgs.__post_init__``.

Registration is light (besides the rooms' packages it imports only ``resolution_hooks``,
which itself imports nothing but ``typing``) and idempotent: SGLang calls ``register`` in
the launcher, the Engine and every scheduler, detokenizer and DP-controller process,
sometimes more than once per process.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.hook_table import HookSpec, PluginNotInstalledError, resolve
from sglang_cp_hicache.v0_5_23 import admission, backup, cache, eviction, launch, selftest, storage
from sglang_cp_hicache.v0_5_23.resolution_steps import (
    ResolutionStep,
    install_resolution_steps,
    missing_resolution_steps,
)

RELEASE = "0.5.23"

HOOKS: Tuple[HookSpec, ...] = (
    launch.HOOKS
    + cache.HOOKS
    + eviction.HOOKS
    + selftest.HOOKS
    + storage.HOOKS
    + backup.HOOKS
    + admission.HOOKS
)
RESOLUTION_STEPS: Tuple[ResolutionStep, ...] = launch.RESOLUTION_STEPS


def register(source: Any = None) -> None:
    """Hand every hook of :data:`HOOKS` to SGLang (``source``: its ``HookSource``) and
    register every step of :data:`RESOLUTION_STEPS`."""
    hook_table.install(HOOKS, source=source)
    install_resolution_steps(RESOLUTION_STEPS)


def install(specs: Iterable[HookSpec], source: Any = None) -> None:
    """Register ``specs`` now or right after their target's import (see ``hook_table``)."""
    hook_table.install(specs, source=source)


def missing_hooks(
    specs: Optional[Iterable[HookSpec]] = None, *, import_targets: bool = True
) -> List[str]:
    """``"target (why)"`` for each spec not in place; by default every hook of
    :data:`HOOKS` and every step of :data:`RESOLUTION_STEPS`.

    ``import_targets=True`` imports every target module (``sglang.srt.entrypoints.engine``
    among them) and every hook callable; ``False`` imports nothing.
    """
    if specs is not None:
        return hook_table.missing_hooks(specs, import_targets=import_targets)
    return hook_table.missing_hooks(HOOKS, import_targets=import_targets) + (
        missing_resolution_steps(RESOLUTION_STEPS, import_targets=import_targets)
    )


def verify_hooks_installed(*, import_targets: bool = True) -> None:
    """Raise :class:`PluginNotInstalledError` naming every hook and step not in place."""
    hook_table.raise_if_missing(missing_hooks(import_targets=import_targets), RELEASE)


__all__ = [
    "HOOKS",
    "RESOLUTION_STEPS",
    "HookSpec",
    "PluginNotInstalledError",
    "RELEASE",
    "ResolutionStep",
    "install",
    "install_resolution_steps",
    "missing_hooks",
    "missing_resolution_steps",
    "register",
    "resolve",
    "verify_hooks_installed",
]
