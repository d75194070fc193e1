"""The 0.5.12.post1 line's PD roles: CP prefill ranks and one decode server, real stack end to end.

Each prefill rank (one process, gloo CP group) is the plugin's cache stack (physical NSA pools,
logical owner-lane allocator, CP HiCache; with ``draft``, the MTP draft's pool beside) driven
as SGLang's disaggregated prefill scheduler drives it: upstream's ``PrefillBootstrapQueue``
(its ``MooncakeKVManager`` and ``MooncakeKVSender``), admission (prefix match, host
load-back), chunked forwards through ``alloc_for_extend``, ``send_kv_chunk`` of upstream's
prefill mixin, the CP-all-reduced poll, ``release_kv_cache``. The forward's KV stores are the
deterministic pattern of :mod:`nsa_stack` (owned tokens only, as the shared-KV write path
stores them). The plugin is loaded as SGLang loads it, so its owner filters run inside
upstream's sender.

The decode server (cp 1, one process) holds a full, unsharded pool and runs upstream's
``DecodePreallocQueue`` / ``DecodeTransferQueue`` (``MooncakeKVReceiver``). Its pool starts
filled with a sentinel; after each transfer it checks, byte for byte against the pattern
(the replicated reference: what an unsharded prefill holds), every token's KV, indexer
K/scale and draft KV, the first output token carried as aux data, and at the end that no
page outside the ones it granted changed.

Only the ``Scheduler`` object is a stand-in (it needs a model and a GPU): the dataclasses
below carry exactly the fields upstream's PD queues read. SGLang's parallel-state groups are
stand-ins of the same kind (:class:`GroupShape`): the PD managers read only their sizes and
ranks; the collectives run on the real gloo groups.

Import from the module that defines a name. Modules: ``scenario`` (the scenario, the planted filter, the pools' buffers), ``line`` (:data:`LINE`, the roles for ``testing.pd.cluster``'s runners), ``context``
(the SGLang stand-ins), ``prefill``, ``decode``.
"""
