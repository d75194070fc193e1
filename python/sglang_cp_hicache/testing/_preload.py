"""Imported once by the forkserver: CPU runtime first, then SGLang's cache stack."""

from sglang_cp_hicache.testing import install

install()

import sglang.srt.mem_cache.hiradix_cache  # noqa: E402,F401  (warm import for forked ranks)
