"""The 0.5.23 line's PD roles: sharded prefill CP ranks and one decode server, real bytes end to end.

Each prefill rank (one process, gloo CP group) is upstream 0.5.23's real sharded DSA HiCache
stack with the plugin's flag (:func:`~sglang_cp_hicache.testing.v0_5_23.stack.build_sharded_stack`,
``StackConfig(cp_shared_kv=True)``: ``PageInterleaveDSATokenToKVPool``,
``PageInterleavePoolAllocator``, ``UnifiedRadixCache`` with a ``PageInterleaveHostPool``)
under upstream's own PD prefill code: ``PrefillBootstrapQueue`` (its ``MooncakeKVManager``
builds ``KVArgs`` from the sharded pool and registers ``enable_kv_cache_sharding`` with the
bootstrap server), ``pop_bootstrapped`` all-reduced over CP, upstream's ``send_kv_chunk``
per chunk (its ``MooncakeKVSender`` owner-filters the pages with
``filter_kv_indices_for_shard_rank``, the DSA indexer pages with
``_prepare_sharded_dsa_indices``), the CP-all-reduced poll. The harness drives the cache as
the scheduler's admission does, through the stack's own calls (prefix match, host load-back,
``alloc_extend`` continuing the chain's rotation, insert after the transfer); a forward's
stores are a deterministic pattern written into the rows the rank owns.

The decode server (cp 1, one process) holds a full, unsharded ``DSATokenToKVPool`` under
upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` (``MooncakeKVReceiver``): its
free pages scattered, its bytes a sentinel. After each transfer it checks, byte for byte
against the pattern (what a replicated prefill holds), every token's MLA KV row and DSA
indexer K/scale, and at the end that no page outside the ones it granted changed.

With ``PDScenario.draft`` each prefill rank also holds the MTP draft's one-layer sharded pool
(:func:`build_draft_pool`, as upstream's ``_build_mtp_kv_shard_pool`` builds it) and the decode
a one-layer draft pool under EAGLE; the draft's KV and indexer are checked the same way.

Stand-ins only where a model or a GPU is needed: the ``Scheduler`` objects
(:class:`PrefillSchedulerFields`, :class:`DecodeSchedulerFields` carry exactly what
upstream's PD code reads of them), and the runtime context's parallel groups (gloo).

Entry points (stable names):

* :data:`~.line.LINE` -- this line's roles for ``testing.pd.cluster``'s line-agnostic runners
  (``run_pd_cluster(LINE, scenario)``: one scenario on a fresh cluster, bootstrap,
  ``cp_size`` prefill rank processes, one decode, every process ended on return);
* :func:`prefill_rank_role` / :func:`decode_role` -- the roles, for a
  :class:`~sglang_cp_hicache.testing.pd.roles.PDCluster` a caller arranges itself (faults);
* in-process, for another harness that already runs the prefill ranks (the simulator's
  ``--pd``), in each rank process (``os.environ.update(role_env(PDEnv()))`` before the KV
  manager is built; the CP group of a :class:`~sglang_cp_hicache.testing.dist.RankContext`):
  ``PrefillRank(ctx, scenario, ports, stack=its_sharded_stack)``, then per finished request
  :meth:`PrefillRank.send_prefilled` (the caller's ``req_to_token`` row, its KV already
  stored; no cache call; every rank, same order), or :meth:`PrefillRank.serve` (the harness
  runs the request's admission, stores, send, insert and release itself). The bootstrap and
  the decode run in a ``PDCluster`` of the caller's (its ``ports``):
  ``DecodeServer(scenario, ports, pattern=...)`` then :meth:`DecodeServer.serve` per request
  (``keep=False`` gives each request's pages back once checked). The decode checks bytes
  against a :class:`KVPattern`: the caller's own (``HARNESS_PATTERN``, what
  :func:`write_owned_kv` stores, by default).

Import from the module that defines a name. Modules: ``scenario`` (the scenario, the byte pattern, the draft pool, the planted filter),
``line`` (:data:`LINE`, the roles for ``testing.pd.cluster``'s runners), ``context`` (the published runtime, the scheduler stand-ins), ``prefill``, ``decode``.
"""
