"""Every hook the plugin puts into SGLang, handed to ``HookRegistry`` without heavy imports.

The table :data:`HOOKS` names each target and each hook callable by ``module:qualname``, so
nothing is imported to describe it. :func:`install` hands each spec to SGLang's
``HookRegistry``:

* target module already imported (``sglang.srt.server_args`` in the launcher): registered
  now, applied by ``load_plugins()`` right after the plugins run;
* otherwise: registered and applied by the process-wide post-import watcher right after
  the target module executes, before any other module can ``from target import X``.

A BEFORE/AFTER/AROUND hook is registered as a small trampoline that imports the real
callable on its first call, so neither registering nor applying imports this plugin's
cache, attention or model code (whose imports could reach back into an SGLang module still
being imported). A REPLACE hook must be the object itself (a class keeps ``isinstance``
working); it is imported when its target is applied.

SGLang only logs a hook that fails to apply, so :func:`verify_hooks_installed` proves the
chain holds our hook for every spec and names each one that does not. Imports nothing of
this package that imports it back (``server_args`` and the KV mixin call the check).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_cp_hicache.import_watcher import installed_watcher, is_imported, process_watcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HookSpec:
    """One hook: ``target`` and ``hook`` are ``"module:qualname"`` paths.

    The colon makes the target's module explicit: the watcher must know which import to
    wait for, and a plain dotted path cannot tell module from attribute without importing.
    """

    target: str
    hook: str
    hook_type: str  # a sglang HookType member name

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def dotted_target(self) -> str:
        """The target as ``HookRegistry`` (and its log lines) spell it."""
        return self.target.replace(":", ".", 1)

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


_SERVER_ARGS = "sglang.srt.server_args:ServerArgs"
_OURS_ARGS = "sglang_cp_hicache.server_args"
_NSA_BACKEND = "sglang.srt.layers.attention.nsa_backend:NativeSparseAttnBackend"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer:Indexer"
_NSA_HOOKS = "sglang_cp_hicache.layers.attention.nsa_backend_hooks"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"

HOOKS: Tuple[HookSpec, ...] = (
    # The flag, its carriage into ServerArgs, and validation.
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", f"{_OURS_ARGS}:add_cli_args_after", "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", f"{_OURS_ARGS}:from_cli_args_around", "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__init__", f"{_OURS_ARGS}:init_around", "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__post_init__", f"{_OURS_ARGS}:post_init_after", "AFTER"),
    HookSpec(
        f"{_SERVER_ARGS}.check_server_args",
        "sglang_cp_hicache.launch_check:check_server_args_after",
        "AFTER",
    ),
    # Pools and allocation.
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin._init_pools",
        "sglang_cp_hicache.model_executor.model_runner_kv_cache_mixin:init_pools_around",
        "AROUND",
    ),
    # The host mirror of req_to_token that CP HiCache plans backups from.
    HookSpec(
        "sglang.srt.mem_cache.common:alloc_for_extend",
        "sglang_cp_hicache.mem_cache.common:alloc_for_extend_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common:alloc_for_decode",
        "sglang_cp_hicache.mem_cache.common:alloc_for_decode_around",
        "AROUND",
    ),
    # alloc_for_extend's host snapshot of the batch's logical pages, carried to the forward
    # (the shared-KV page mapping then reads no req_to_token column back).
    HookSpec(
        "sglang.srt.managers.schedule_batch:ScheduleBatch.get_model_worker_batch",
        "sglang_cp_hicache.managers.schedule_batch:get_model_worker_batch_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new",
        "sglang_cp_hicache.model_executor.forward_batch_info:init_new_around",
        "AROUND",
    ),
    # Safe to replace: the scheduler imports HiRadixCache lazily, after hooks apply, and
    # the subclass is upstream HiRadixCache unless the allocator is the CP one.
    HookSpec(
        "sglang.srt.mem_cache.hiradix_cache:HiRadixCache",
        "sglang_cp_hicache.mem_cache.hiradix_cache:CpHiRadixCache",
        "REPLACE",
    ),
    # The MTP draft's KV on host: the cache gets the draft pool when it is built (one host
    # object, one budget); upstream's MLA-only draft host pool registration is replaced.
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler.init_cache_with_memory_pool",
        "sglang_cp_hicache.managers.scheduler:init_cache_with_memory_pool_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler._maybe_register_hicache_draft",
        "sglang_cp_hicache.managers.scheduler:maybe_register_hicache_draft_around",
        "AROUND",
    ),
    # Prefill admission: a request that would split a pending host backup waits a round; a
    # batch never reads more KV pages than the dense buffers hold.
    HookSpec(
        "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
        "sglang_cp_hicache.managers.schedule_policy:add_one_req_around",
        "AROUND",
    ),
    # Host pages of a prefill batch's new leaves reserved before its forward.
    HookSpec(
        "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_extend",
        "sglang_cp_hicache.managers.schedule_batch:prepare_for_extend_after",
        "AFTER",
    ),
    # Shared-KV attention runtime: write translation, prefix materialisation.
    HookSpec(f"{_NSA_BACKEND}.init_forward_metadata", f"{_NSA_HOOKS}:init_forward_metadata_around", "AROUND"),
    HookSpec(f"{_NSA_BACKEND}.forward_extend", f"{_NSA_HOOKS}:forward_extend_around", "AROUND"),
    HookSpec(f"{_INDEXER}.forward_cuda", f"{_NSA_HOOKS}:indexer_forward_around", "AROUND"),
    HookSpec(f"{_INDEXER}._store_index_k_cache", f"{_NSA_HOOKS}:store_index_k_cache_around", "AROUND"),
    HookSpec(
        "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.forward",
        f"{_NSA_HOOKS}:model_forward_around",
        "AROUND",
    ),
    # The NSA MTP draft (DeepSeek-V3.2 and GLM-5 drafts are both this class) overrides
    # forward; its prefill extend materialises its one layer's prefix the same way.
    HookSpec(
        "sglang.srt.models.deepseek_nextn:DeepseekV3ForCausalLMNextN.forward",
        f"{_NSA_HOOKS}:model_forward_around",
        "AROUND",
    ),
    # Startup: the materialisation group and the read-path self-test, the dense-buffer
    # budget out of the KV pool, warm-up DECODE dummy runs.
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin.init_memory_pool",
        "sglang_cp_hicache.layers.attention.cp_shared_kv_selftest:init_memory_pool_around",
        "AROUND",
    ),
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin._profile_available_bytes",
        "sglang_cp_hicache.layers.attention.cp_shared_kv_budget:profile_available_bytes_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner._dummy_run",
        f"{_NSA_HOOKS}:dummy_run_around",
        "AROUND",
    ),
    # PD transfer: each CP rank sends only the pages (and NSA state pages) it owns.
    HookSpec(
        "sglang.srt.disaggregation.utils:filter_kv_indices_for_cp_rank",
        "sglang_cp_hicache.disaggregation.utils:filter_kv_indices_for_cp_rank_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.maybe_send_extra",
        "sglang_cp_hicache.disaggregation.mooncake.conn:maybe_send_extra_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.send_kvcache_hisparse",
        "sglang_cp_hicache.disaggregation.mooncake.conn:send_kvcache_hisparse_around",
        "AROUND",
    ),
)


class PluginNotInstalledError(RuntimeError):
    """A hook the plugin needs is not in place in this process."""


def resolve(path: str) -> Any:
    """The object a ``"module:qualname"`` path names (imports the module)."""
    return pkgutil.resolve_name(path)


# Per spec, what was handed to HookRegistry (trampoline or REPLACE object): the check
# looks for this very object in the installed wrapper chain.
_handed: Dict[HookSpec, Callable] = {}
_deferred: Set[HookSpec] = set()  # waiting for their target module's import
_errors: Dict[HookSpec, str] = {}  # why handing over failed
_lock = threading.RLock()


def _trampoline(spec: HookSpec) -> Callable:
    """A stand-in for ``spec.hook`` that imports the real callable on its first call."""
    resolved: List[Callable] = []

    def call_hook(*args, **kwargs):
        if not resolved:
            resolved.append(resolve(spec.hook))
        return resolved[0](*args, **kwargs)

    call_hook.__qualname__ = call_hook.__name__ = f"lazy[{spec.hook}]"
    return call_hook


def _hook_object(spec: HookSpec) -> Callable:
    with _lock:
        obj = _handed.get(spec)
        if obj is None:
            obj = resolve(spec.hook) if spec.hook_type == "REPLACE" else _trampoline(spec)
            _handed[spec] = obj
        return obj


def _register(spec: HookSpec, source: Any) -> None:
    """``HookRegistry.register`` once per spec: a second ``install`` (now or, through a
    second watcher callback, at import) finds the same hook object registered."""
    try:
        hook = _hook_object(spec)
        if any(h is hook for _, h, _ in HookRegistry._hooks.get(spec.dotted_target, ())):
            return
        HookRegistry.register(spec.dotted_target, hook, HookType[spec.hook_type], source=source)
    except Exception as exc:
        _errors[spec] = f"{type(exc).__name__}: {exc}"
        logger.exception("cp_hicache: cannot register the hook on %s", spec.dotted_target)


def _register_and_apply(spec: HookSpec, source: Any, _module: ModuleType) -> None:
    with _lock:
        _deferred.discard(spec)
    _register(spec, source)
    HookRegistry.apply_hooks()


def install(specs: Iterable[HookSpec], source: Any = None) -> None:
    """Register ``specs`` now (target imported) or right after their target's import.

    ``source`` is SGLang's ``HookSource`` for log lines. Imports no target module, and a
    spec that cannot be registered is logged and named by the check, never raised.
    """
    watcher = process_watcher()
    for spec in specs:
        if is_imported(spec.module):
            _register(spec, source)
            continue
        with _lock:
            _deferred.add(spec)

        def on_import(module: ModuleType, spec: HookSpec = spec) -> None:
            _register_and_apply(spec, source, module)

        watcher.when_imported(spec.module, on_import)


# ------------------------------------------------------------------------------- check
def _hook_in_chain(obj: object, hook: Callable) -> bool:
    """Walk SGLang's wrapper chain (``__wrapped__``) looking for ``hook`` in a closure."""
    if isinstance(hook, type):
        return isinstance(obj, type) and issubclass(obj, hook)
    seen = 0
    while obj is not None and seen < 64:
        func = getattr(obj, "__func__", obj)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        obj = getattr(func, "__wrapped__", None)
        seen += 1
    return False


def _installed_attr(spec: HookSpec) -> Any:
    """The target's current attribute (raw ``__dict__`` entry for class attributes)."""
    *owner_path, attr = spec.qualname.split(".")
    owner: Any = sys.modules[spec.module]
    for part in owner_path:
        owner = getattr(owner, part)
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _waiting_for_import(spec: HookSpec) -> bool:
    watcher = installed_watcher()
    return spec in _deferred and watcher is not None and spec.module in watcher.pending()


def _why_missing(spec: HookSpec, import_targets: bool) -> Optional[str]:
    """None when ``spec``'s hook is in place (or waits for its target's import); else why."""
    if not is_imported(spec.module):
        if not import_targets:
            return None if _waiting_for_import(spec) else "not watching for its module's import"
        try:
            importlib.import_module(spec.module)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    if spec in _errors:
        return _errors[spec]
    hook = _handed.get(spec)
    if hook is None:
        return "never registered in this process"
    try:
        installed = _installed_attr(spec)
    except Exception as exc:  # renamed target
        return f"{type(exc).__name__}: {exc}"
    if not _hook_in_chain(installed, hook):
        return "not in the installed chain"
    if import_targets and spec.hook_type != "REPLACE":
        try:  # the trampoline's first call must not be where a broken import shows up
            resolve(spec.hook)
        except Exception as exc:
            return f"{spec.hook}: {type(exc).__name__}: {exc}"
    return None


def missing_hooks(
    specs: Optional[Iterable[HookSpec]] = None, *, import_targets: bool = True
) -> List[str]:
    """``"target (why)"`` for each spec (default: :data:`HOOKS`) whose hook is not in place.

    ``import_targets=True`` imports every target module (running the watcher) and every
    hook callable. ``False`` imports nothing: a spec whose target module is not imported
    yet counts as in place while the watcher waits for that import.
    """
    missing = []
    for spec in HOOKS if specs is None else specs:
        why = _why_missing(spec, import_targets)
        if why is not None:
            missing.append(f"{spec.dotted_target} ({why})")
    return missing


def verify_hooks_installed(*, import_targets: bool = True) -> None:
    """Raise :class:`PluginNotInstalledError` naming every hook not in place."""
    missing = missing_hooks(import_targets=import_targets)
    if missing:
        raise PluginNotInstalledError(
            "--enable-nsa-prefill-cp-shared-kv: the sglang-cp-hicache plugin is not fully "
            "installed in this process; these hooks are missing: "
            + ", ".join(missing)
            + ". Check that the package is pip-installed next to sglang==0.5.12.post1, that "
            "SGLANG_PLUGINS (if set) includes 'cp_hicache', and the log lines "
            "'Failed to apply hooks to ...' above."
        )
