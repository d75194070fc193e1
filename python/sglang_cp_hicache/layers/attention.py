"""Attention read path under CP shared KV.

Each rank's pool holds only its owned pages, so NSA attention and the indexer must read
prefix pages they do not own through a cross-rank materialisation step. That step is not
part of this release yet; until it is, a real server must refuse to serve rather than read
pages that were never written on this rank.
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
