"""How the attention hooks reach the cache controller that backs up layer by layer.

Producer: the NSA backend's extend hook (``layers/attention/nsa_backend_hooks``) calls
:func:`notify_layer_stored` once a layer's MLA KV and index K stores are issued, and the
model-forward hook calls :func:`notify_forward_end` when the forward returns or raises.

Consumer: a controller with per-layer backups registers itself on its *device KV pool*,
the very object each forward batch carries as ``token_to_kv_pool``. So the registry needs
no process global, two cache stacks in one process stay apart, and a pool nobody registered
on (upstream HiCache's, a draft model's without CP HiCache) costs one dict lookup per layer.
The listener is read from the pool's own ``__dict__``, where :func:`register` put it, never by
``getattr``: a pool that answers every name (a ``MagicMock``) has no listener.
With the MTP draft's KV on host, the draft pool has its own listener (the controller's draft
stage), told of the draft forward's layer after the target forward.

Also the table of host layouts that can back up one layer at a time
(:func:`per_layer_backup_problem`), kept here because ``server_args`` checks it at startup
and must not import SGLang's host pools (and ``sgl_kernel``) to do so.

Layer ids: the hooks pass the model's layer id; the listener gets the pool-local index
``layer_id - pool.start_layer`` (0 .. ``layer_num - 1``), the index the host pools use.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

_ATTR = "_cp_hicache_layer_backup_listener"

# (io backend, host layout) with a per-layer device->host op in sgl_kernel 0.4.2.post2.
PER_LAYER_D2H_LAYOUTS = (
    ("kernel", "layer_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
)
# ... and the HiCache combinations without one, with why.
_NO_PER_LAYER_D2H = {
    ("kernel", "page_first"): (
        "sgl_kernel.kvcacheio has no per-layer device->host op into a page_first host "
        "buffer (only transfer_kv_all_layer_mla_lf_pf, for all layers at once)"
    ),
}


def per_layer_backup_problem(io_backend: str, layout: str) -> Optional[str]:
    """Why ``(io_backend, layout)`` cannot back up one layer at a time; None when it can."""
    reason = _NO_PER_LAYER_D2H.get((io_backend, layout))
    if reason is not None:
        return f"io backend {io_backend!r} with host layout {layout!r}: {reason}"
    if (io_backend, layout) not in PER_LAYER_D2H_LAYOUTS:
        return f"io backend {io_backend!r} with host layout {layout!r} has no per-layer backup"
    return None


class LayerBackupListener(Protocol):
    def backup_layer(self, layer_id: int) -> None:
        """Layer ``layer_id``'s KV stores of the running forward are issued."""

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        """The model forward returned (``error`` None) or raised ``error``."""


def register(device_pool: Any, listener: LayerBackupListener) -> None:
    """Route ``device_pool``'s layer notifications to ``listener`` (the last one wins:
    one cache controller per pool)."""
    setattr(device_pool, _ATTR, listener)


def unregister(device_pool: Any, listener: LayerBackupListener) -> None:
    if listener_of(device_pool) is listener:
        delattr(device_pool, _ATTR)


def listener_of(device_pool: Any) -> Optional[LayerBackupListener]:
    # What own_objects.plugin_attr does, kept here: server_args imports this module at
    # registration, which may import only the light modules test_light_registration lists.
    try:
        return vars(device_pool).get(_ATTR)
    except TypeError:  # no instance __dict__: nobody registered on it
        return None


def notify_layer_stored(device_pool: Any, layer_id: int) -> None:
    """Called after model layer ``layer_id``'s KV and index K stores are issued."""
    listener = listener_of(device_pool)
    if listener is not None:
        listener.backup_layer(layer_id - device_pool.start_layer)


def notify_forward_end(device_pool: Any, error: Optional[BaseException] = None) -> None:
    """Called when the model forward over ``device_pool`` returned or raised."""
    listener = listener_of(device_pool)
    if listener is not None:
        listener.end_forward(error)
