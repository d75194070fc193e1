"""The SGLang 0.5.23 line of the plugin.

0.5.23 shards KV natively (``--enable-kv-cache-sharding``: owner = logical page % N, the
same layout as ours); this line turns it on under ``--enable-nsa-prefill-cp-shared-kv`` and
adds only what upstream lacks. Its hook table is :mod:`.hooks`, joined from its rooms; the
flag and its resolution steps are the launch room's (``launch/flag.py``, ``launch/resolution.py``),
the mode they decide once is ``launch/cp_mode.py``.

Never imports the 0.5.12.post1 line (``sglang_cp_hicache.v0_5_12``), nor is imported by it:
shared pure logic lives in ``sglang_cp_hicache.core``.
"""
