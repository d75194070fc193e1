"""SGLang's page-hash extension built before the servers serve (a harness workaround for
upstream's lazy build).

A HiCache L3 tier names pages by a hash that SGLang computes with a C++ extension torch
builds on first use (``hicache_hash_cpp``: ``sglang/srt/mem_cache/cpp_utils/native_hash.py``
through ``utils/cpp_extension_loader.py``). Upstream loads it lazily, at the first storage
query (``HybridCacheController._storage_hit_query``, the prefetch thread), so the first
request with a full page after a server start waits for a g++ build: 13 s on a quiet 2-core
box, over 30 s on a loaded one. Past the decode's PD wait
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``) the decode aborts the request, and a streamed
answer is then HTTP 200 with no token (``docs/serving_on_cpu.md``). The harness builds the
extension once per run, into the run folder's extension cache (``TORCH_EXTENSIONS_DIR``,
:class:`~sglang_cp_hicache.testing.server.launch.ServerEnv`), while the servers start, and
waits for it before any request.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

logger = logging.getLogger(__name__)

NATIVE_HASH = "hicache_hash_cpp"
PREBUILD_S = 600.0  # g++ on 2 cores shared with starting servers
_BUILD = (
    "from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash; "
    "get_native_hash(list(range(64)), None, 64)"
)


class PrebuildFailed(RuntimeError):
    """The extension did not build; the message carries the build log's tail."""


class NativeHashPrebuild:
    """One build of ``hicache_hash_cpp`` into ``env``'s ``TORCH_EXTENSIONS_DIR``, in its own
    process group (ended by :meth:`stop`), its output in ``log_path``."""

    def __init__(self, env: Dict[str, str], log_path: Path):
        self.env = dict(env)
        self.log_path = log_path
        self._popen: Optional[subprocess.Popen] = None
        self.built_s: Optional[float] = None
        self._started = 0.0

    @property
    def library(self) -> Path:
        """The built library, where the servers' loader finds it."""
        return Path(self.env["TORCH_EXTENSIONS_DIR"]) / NATIVE_HASH / f"{NATIVE_HASH}.so"

    def start(self) -> "NativeHashPrebuild":
        """Start the build unless it was started."""
        if self._popen is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _BUILD], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env, start_new_session=True,
            )  # fmt: skip
        self._started = time.monotonic()
        return self

    def wait(self, timeout_s: float = PREBUILD_S) -> float:
        """Block until the build is done (at once when it was); its seconds. Raises
        :class:`PrebuildFailed` when it fails or runs past ``timeout_s`` (then ended)."""
        if self.built_s is not None:
            return self.built_s
        if self._popen is None:
            raise PrebuildFailed(f"{NATIVE_HASH}: the build was never started")
        try:
            code = self._popen.wait(timeout=max(0.0, timeout_s - (time.monotonic() - self._started)))
        except subprocess.TimeoutExpired:
            self.stop()
            raise PrebuildFailed(f"{NATIVE_HASH} not built after {timeout_s:.0f} s:\n{self._tail()}") from None
        if code != 0 or not self.library.exists():
            raise PrebuildFailed(f"{NATIVE_HASH} build exited {code}:\n{self._tail()}")
        self.built_s = time.monotonic() - self._started
        logger.info("%s built in %.1f s: %s", NATIVE_HASH, self.built_s, self.library)
        return self.built_s

    def stop(self) -> None:
        """End the build's process group if it still runs."""
        if self._popen is None or self._popen.poll() is not None:
            return
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._popen.wait(timeout=10)

    def _tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


__all__ = ["NATIVE_HASH", "NativeHashPrebuild", "PREBUILD_S", "PrebuildFailed"]
