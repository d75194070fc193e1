"""NSA attention under CP shared KV (see docs/attention_runtime.md).

Each rank's pool holds only its owned pages, so NSA attention and the indexer read prefix
pages they do not own through a per-layer cross-rank materialisation:

* :mod:`.cp_shared_kv_write`: logical ``out_cache_loc`` -> physical / padding-page locs;
* :mod:`.cp_shared_kv_mapping`: the batch's dense page layout, built once per forward;
* :mod:`.cp_shared_kv_materialize`: per-layer dense buffers (all-reduce or all-gather);
* :mod:`.nsa_backend_hooks`: the AROUND hooks on SGLang's NSA backend, indexer and model;
* :mod:`.cp_shared_kv_support`: the serving modes refused at startup.

The torch reference of NSA sparse MLA prefill and the shared-vs-replicated twin harness
are test-only and live in :mod:`sglang_cp_hicache.testing`.

The read path is implemented and its hooks are registered, but it has not run on a GPU
yet, so a real server still refuses to serve (:func:`require_shared_kv_read_path`).
"""

from __future__ import annotations


class SharedKVReadPathMissing(RuntimeError):
    """Raised when a real forward pass would need the prefix materialisation read path."""


SHARED_KV_READ_PATH_AVAILABLE = False


def require_shared_kv_read_path() -> None:
    if not SHARED_KV_READ_PATH_AVAILABLE:
        raise SharedKVReadPathMissing(
            "--enable-nsa-prefill-cp-shared-kv: this build of sglang-cp-hicache has the "
            "owner-lane KV substrate and CP HiCache, but not yet the NSA prefix "
            "materialisation read path, so a real server would attend to KV pages this "
            "rank does not hold. Refusing to serve. Use `python -m sglang_cp_hicache.sim` "
            "(CPU simulator) to exercise the cache stack, or run without the flag."
        )
