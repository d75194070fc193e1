"""AFTER hook of ``ServerArgs.check_server_args``: what only a real launch must refuse.

Runs once in the main process, before schedulers spawn. Kept apart from
:mod:`sglang_cp_hicache.v0_5_12.server_args` because the serving-mode rules live with the attention
runtime, which itself imports the flag's names from ``server_args``: one import direction.
Imports no SGLang cache, model or kernel module.
"""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_support import unsupported_serving_modes
from sglang_cp_hicache.v0_5_12.server_args import (
    CpSharedKVConfigError,
    is_cp_shared_kv_enabled,
    validate_cp_shared_kv_args,
)


def check_server_args_after(result: Any, self: Any) -> None:
    """Refuse every unsupported combination, then unsupported serving modes (flag off:
    nothing). The read path is proven per rank at init by the startup self-test."""
    validate_cp_shared_kv_args(self)
    if is_cp_shared_kv_enabled(self):
        problems = unsupported_serving_modes(self)
        if problems:
            raise CpSharedKVConfigError("; ".join(problems))
    return None
