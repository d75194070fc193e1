"""Wrappers of named steps of SGLang 0.5.23's server-args resolution pipeline
(``sglang.srt.arg_groups.resolution_hooks.register_resolution_hook``).

0.5.23 resolves server args in a pipeline of named steps, not in
``ServerArgs.__post_init__``, so the flag's validation and its turning on of upstream's KV
sharding are wrappers of steps (the launch room's ``RESOLUTION_STEPS``). The 0.5.12.post1
line has no such pipeline, so this stays on this line beside the shared ``hook_table``.

Registration is once per process and idempotent: SGLang calls the plugin's ``register`` in
several processes, sometimes more than once per process, so the wrapper handed to SGLang
for a step is kept and a second registration finds it in SGLang's list. Imports nothing
but ``resolution_hooks`` (which imports only ``typing``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

from sglang.srt.arg_groups import resolution_hooks

from sglang_cp_hicache.hook_table import resolve

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolutionStep:
    """One wrapper ``hook(server_args, previous)`` of the pipeline step named ``step``.

    ``step`` must be one of SGLang's overridable names; ``hook`` is a ``"module:qualname"``
    path, imported on the wrapper's first call.
    """

    step: str
    hook: str

    @property
    def label(self) -> str:
        """How the check names this step."""
        return f"resolution step {self.step}"


# Per step, the wrapper handed to register_resolution_hook: the check looks for this very
# object in SGLang's list, and a second registration finds it there.
_step_wrappers: Dict[ResolutionStep, Callable[[Any, Callable[[Any], None]], None]] = {}
_step_errors: Dict[ResolutionStep, str] = {}
_lock = threading.RLock()


def _lazy_wrapper(step: ResolutionStep) -> Callable[[Any, Callable[[Any], None]], None]:
    """A stand-in for ``step.hook`` that imports the real callable on its first call."""
    resolved: List[Callable[[Any, Callable[[Any], None]], None]] = []

    def run_step(server_args: Any, previous: Callable[[Any], None]) -> None:
        if not resolved:
            resolved.append(resolve(step.hook))
        resolved[0](server_args, previous)

    run_step.__qualname__ = run_step.__name__ = f"lazy[{step.hook}]"
    return run_step


def _registered(step: ResolutionStep, wrapper: Callable) -> bool:
    return any(fn is wrapper for fn in resolution_hooks._HOOKS.get(step.step, ()))


def install_resolution_steps(steps: Iterable[ResolutionStep]) -> None:
    """Register each of ``steps`` once per process; a step SGLang refuses (a name that is
    not overridable, e.g. renamed upstream) is logged and named by the check, never raised."""
    with _lock:
        for step in steps:
            wrapper = _step_wrappers.get(step)
            if wrapper is None:
                wrapper = _step_wrappers[step] = _lazy_wrapper(step)
            if _registered(step, wrapper):
                continue
            try:
                resolution_hooks.register_resolution_hook(step.step)(wrapper)
            except Exception as exc:
                _step_errors[step] = f"{type(exc).__name__}: {exc}"
                logger.exception("cp_hicache: cannot register the %s", step.label)


def _why_step_missing(step: ResolutionStep, import_targets: bool) -> Optional[str]:
    if step in _step_errors:
        return _step_errors[step]
    wrapper = _step_wrappers.get(step)
    if wrapper is None:
        return "never registered in this process"
    if not _registered(step, wrapper):
        return "not in SGLang's wrappers of this step"
    if import_targets:
        try:  # the wrapper's first call must not be where a broken import shows up
            resolve(step.hook)
        except Exception as exc:
            return f"{step.hook}: {type(exc).__name__}: {exc}"
    return None


def missing_resolution_steps(
    steps: Iterable[ResolutionStep], *, import_targets: bool = True
) -> List[str]:
    """``"resolution step <name> (why)"`` for each of ``steps`` not in place."""
    missing = []
    for step in steps:
        why = _why_step_missing(step, import_targets)
        if why is not None:
            missing.append(f"{step.label} ({why})")
    return missing
