"""Upstream SGLang 0.5.23's sharded DSA read path on CPU ranks, beside its replicated twin.

One prefill extend with a cached prefix runs, on each prefill-CP rank, through the REAL
upstream objects wherever they run on CPU (paths under ``sglang/srt/``):

* ``PageInterleaveDSATokenToKVPool`` (one rank's stripe, gloo shard group): the owner filter
  of every write (``_get_write_plan``, ``write_targets``), ``begin_shard_extend``'s gather
  plan (reached through ``kv_shard_hooks.prepare_kv_shard_forward``), the per-layer prefix
  all-gather one layer ahead (``_prefetch_layer`` / ``_acquire_slot_for_read``),
  ``translate_loc_to_scratch``, the chunk staged into the scratch, ``get_key_buffer`` and
  ``get_index_k_scale_buffer`` (``_PageInterleaveIndexKeyCache`` maps logical pages through
  ``_page_pos``);
* ``DeepseekSparseAttnBackend`` itself, built as an H200 (SM 9.0) prefill backend in one of
  the two :class:`DsaKvFormat` s an H200 resolves (``flashmla_sparse`` over bf16 rows, or
  ``flashmla_kv`` over the packed fp8 rows) with the torch top-k backend: ``init_forward_metadata``
  (``layers/attention/dsa_backend.py:1095``; the plan :1121, ``page_table_1`` translated
  into scratch rows and the logical page table kept for the indexer :1284-1290),
  ``get_indexer_metadata`` and its ``topk_transform`` (upstream's torch top-k), and
  ``forward_extend`` (:2164: the pool write, ``get_key_buffer``, the PAGED top-k to
  page-table transform, ``_forward_flashmla_sparse`` or ``_forward_flashmla_kv``);
* prefill CP interleave: ``layers/cp/utils.prepare_cp_forward`` and
  ``InterleaveCPStrategy`` (query sharding, the latent-KV and indexer-key gathers, the
  hidden-state gather).

:class:`CpuKernelStandIns` replaces only what needs a GPU: the Triton/CUDA kernels (for fp8,
the store's quantizer and FlashMLA's sparse decode kernel and schedule,
:mod:`~sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference`), the NCCL collective behind
the CP gathers, and the device capability the backend reads once.
The indexer's own compute (projections, the fp8 MQA logits kernel) is
:class:`StandInIndexer`: upstream's ``Indexer.forward_cuda`` asserts a CUDA device; the
stand-in reads index K exactly where ``Indexer._get_topk_ragged`` does (the pool getter
with the metadata's logical page table) and selects with the metadata's real top-k.

The reference is the same computation on an unsharded ``DSATokenToKVPool`` holding every
page at its logical loc (upstream without ``--enable-kv-cache-sharding``): same rank, same
CP split, same logical locs, inputs and stand-in kernels, so every record compares bit for
bit. Prefixes are page-aligned: a sharded extend refuses any other
(``mem_cache/page_interleave_pool.py:378-383``, in ``begin_shard_extend``). A chunked prefill
(:meth:`ReadPathRank.compare_chunked_to_replicated`) runs two extends on the same pools, the
second reading as prefix what the first wrote.

Modules: ``formats`` (the two KV formats, the geometry), ``batch`` (the batch and its per-rank
split), ``kernels`` (:class:`CpuKernelStandIns`), ``context`` (the published runtime context),
``model`` (:class:`StandInIndexer`, :class:`ReadPathModel`), ``pools`` (both pools, the real
backend), ``compare`` (sharded against replicated), ``rank`` (:class:`ReadPathRank`,
:func:`read_path_session`). Import from the module that defines a name.
"""
