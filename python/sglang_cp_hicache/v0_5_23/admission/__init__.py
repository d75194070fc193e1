"""Admission room: the requests a server under ``--enable-nsa-prefill-cp-shared-kv``, and a PD
decode server beside it, refuses with HTTP 400 before they reach its scheduler, where
upstream would serve them wrongly or die on them (``request_limits``). Exports its hook
specs by path only: importing this package imports none of its modules.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
_LIMITS = "sglang_cp_hicache.v0_5_23.admission.request_limits"

HOOKS: Tuple[HookSpec, ...] = (
    # Decided once per tokenizer manager: limits attached under the flag or on a PD decode.
    HookSpec(f"{_TM}.__init__", f"{_LIMITS}:tokenizer_manager_init_after", "AFTER"),
    # Per request, after upstream's own checks: a manager without limits is upstream's.
    HookSpec(f"{_TM}._validate_one_request", f"{_LIMITS}:validate_one_request_around", "AROUND"),
)
