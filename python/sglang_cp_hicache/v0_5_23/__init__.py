"""The SGLang 0.5.23 line of the plugin.

0.5.23 shards KV natively (``--enable-kv-cache-sharding``: owner = logical page % N, the
same layout as ours); this line turns it on under ``--enable-nsa-prefill-cp-shared-kv`` and
adds only what upstream lacks. Its hook table is :mod:`.hooks`, the flag and its
resolution steps are :mod:`.server_args`, the mode they decide once is :mod:`.cp_mode`.

Never imports the 0.5.12.post1 line (``sglang_cp_hicache.v0_5_12``), nor is imported by it:
shared pure logic lives in ``sglang_cp_hicache.core``.
"""
