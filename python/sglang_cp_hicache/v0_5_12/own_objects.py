"""How a hook tells the plugin's own objects from foreign ones, without attribute presence.

A hook must not decide "this is ours" from ``getattr``/``hasattr`` on an object SGLang hands
it: a ``MagicMock`` (upstream's scheduler tests build caches, batches and runners from them)
answers every name, and SGLang's ``StreamingSession`` forwards every unknown name to the cache
it wraps. So a hook decides from:

* the flag (``server_args.is_cp_shared_kv_enabled``: only a real ``True``);
* the plugin's own classes (:func:`cp_hiradix_cache`, :func:`cp_hicache_of`);
* an attribute the plugin itself stored on the instance (:func:`plugin_attr`), read from
  the instance's own ``__dict__``, which no ``__getattr__`` can fabricate.

Imports nothing heavy: a flag-off scheduler without HiCache never imports the cache modules.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache

_CP_HIRADIX_MODULE = "sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache"
_STREAMING_SESSION_MODULE = "sglang.srt.session.streaming_session"


def plugin_attr(obj: Any, name: str) -> Any:
    """What the plugin stored on ``obj`` as ``name`` (``setattr`` on the instance), or None."""
    try:
        return vars(obj).get(name)
    except TypeError:  # no instance __dict__: the plugin stored nothing there
        return None


def _loaded_class(module_name: str, class_name: str) -> Optional[type]:
    """``class_name`` of ``module_name`` if that module was imported, else None.

    A class has no instance before its module runs, so an ``isinstance`` check against a
    class whose module is not loaded is False without importing it (importing the cache
    modules from a flag-off scheduler's hot path would pull in HiCache).
    """
    module = sys.modules.get(module_name)
    return None if module is None else getattr(module, class_name, None)


def _unwrap_streaming_session(tree_cache: Any) -> Any:
    """The cache inside SGLang's ``StreamingSession`` (the one wrapper SGLang puts around a
    tree cache, ``Scheduler.init_cache_with_memory_pool``), else ``tree_cache`` itself."""
    session_cls = _loaded_class(_STREAMING_SESSION_MODULE, "StreamingSession")
    if session_cls is not None and isinstance(tree_cache, session_cls):
        return tree_cache.inner
    return tree_cache


def cp_hiradix_cache(tree_cache: Any) -> Optional["CpHiRadixCache"]:
    """The plugin's ``CpHiRadixCache`` that ``tree_cache`` is (or a ``StreamingSession``
    wraps), in either mode; None for every other object."""
    cache = _unwrap_streaming_session(tree_cache)
    cache_cls = _loaded_class(_CP_HIRADIX_MODULE, "CpHiRadixCache")
    if cache_cls is not None and isinstance(cache, cache_cls):
        return cache
    return None


def cp_hicache_of(tree_cache: Any) -> Optional["CpHiRadixCache"]:
    """Like :func:`cp_hiradix_cache`, but only a cache in CP mode (built over the CP
    allocator, so the flag is on): the one the CP HiCache hooks act on."""
    cache = cp_hiradix_cache(tree_cache)
    return cache if cache is not None and cache.uses_cp_hicache else None
