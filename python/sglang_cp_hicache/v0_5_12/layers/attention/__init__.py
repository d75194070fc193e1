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

A real server proves the read path on its own GPUs before serving: every rank runs
:mod:`.cp_shared_kv_selftest` at init (hook on ``ModelRunner.init_memory_pool``) and
refuses to serve, naming the failing stage, on any mismatch.
"""
