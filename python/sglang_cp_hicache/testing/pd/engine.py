"""The Mooncake transfer engine a PD role runs on, the bytes it sends, and the errors its
logs carry."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, List

from sglang_cp_hicache.testing.pd.roles import LOOPBACK


# ------------------------------------------------------------------ engine and logs
def init_transfer_engine() -> Any:
    """This process's Mooncake transfer engine on loopback (TCP, ``MC_FORCE_TCP``)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    return init_mooncake_transfer_engine(hostname=LOOPBACK, gpu_id=0)


class SentBytesMeter:
    """Counts the bytes each ``batch_transfer_sync`` hands to the engine (delegates).

    Upstream calls the engine from its transfer thread pool, one call per layer at once
    (``mooncake/conn.py``, ``executor.submit``): the counts are updated under a lock, or
    concurrent ``+=`` would lose bytes.
    """

    def __init__(self, engine: Any):
        self.total = 0
        self.engine_s = 0.0
        self._lock = threading.Lock()
        original = engine.batch_transfer_sync

        def counted(session_id, buffers, peer_buffer_addresses, lengths):
            with self._lock:
                self.total += int(sum(lengths))
            start = time.monotonic()
            try:
                return original(session_id, buffers, peer_buffer_addresses, lengths)
            finally:
                with self._lock:
                    self.engine_s += time.monotonic() - start

        engine.batch_transfer_sync = counted


class ErrorLog(logging.Handler):
    """Collects the ERROR records of SGLang's disaggregation loggers."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.messages: List[str] = []
        logging.getLogger("sglang.srt.disaggregation").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


__all__ = [
    "ErrorLog",
    "SentBytesMeter",
    "init_transfer_engine",
]
