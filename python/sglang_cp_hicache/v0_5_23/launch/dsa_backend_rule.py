"""DSA KV sharding on Hopper (SM90) under ``--enable-nsa-prefill-cp-shared-kv``.

Upstream 0.5.23's sharding gate (``handle_kv_cache_sharding``) checks the DSA attention
backend in ``validate_kv_shard_attention_backend`` (``arg_groups/kv_shard_hook.py:30-65``):
CUDA interleave prefill CP > 1 and PP 1; then trtllm prefill *and* decode, ``fp8_e4m3`` KV,
page 64 (:45-54), a Blackwell-only triple; then Mooncake, ``index_kpool == 1``, no layer
split. A default H200 launch resolves ``bfloat16`` KV with ``flashmla_sparse`` prefill and
``fa3`` decode, or ``fp8_e4m3`` with ``flashmla_kv`` for both (``overrides.py:714-726``), and
both are refused there, although the shard-aware parts of ``DeepseekSparseAttnBackend``
(plan, ``translate_loc_to_scratch``, scratch bounds; ``dsa_backend.py:1121, 1284-1290,
1332``) do not depend on the sub-backend.

:func:`validate_dsa_backend_around` wraps that check (an AROUND: ``handle_kv_cache_sharding``
calls it by its module-global name). With the plugin's flag on a DSA model it admits, beside
upstream's own triple, the :data:`ADMITTED` Hopper ones: only formats whose scratch-translated
tables a CPU twin checks against the replicated pool, bit for bit, at cp 2, 3 and 8 with planted
mistranslations (``testing/v0_5_23/read_path/``; tests under
``test/registered/multi_rank/v0_5_23/native/``: ``test_native_read_path_multi_rank.py``,
``test_read_path_cp8_multi_rank.py``, ``test_read_path_fp8_multi_rank.py``):

* ``flashmla_sparse`` over bf16 rows (token-level ``page_table_1``), decode ``fa3``;
* ``flashmla_kv`` over the packed fp8 rows (656 bytes) through 64-token blocks, decode
  ``flashmla_kv``.

Speculative decoding (EAGLE MTP) is admitted on both: a PD prefill worker runs the draft's
extend with the batch's EXTEND mode, so the draft's DSA backend reads its own sharded pool's
translated tables with the format's *prefill* kernel, never the decode one
(``dsa_backend.py:1129-1138``; twinned in ``test_read_path_mtp_draft_multi_rank.py``).
Upstream's MTP rules under sharding (GLM DSA, one NextN layer, EAGLE, top-k 1) stay its own.
Anything else is refused naming what is admitted on that GPU: an unproven read of translated
tables could serve wrong KV silently. An admitted Hopper triple then runs upstream's check
unchanged, shown upstream's own triple for its backend rule (a ``FieldOverlay``): every
other rule of the check (CUDA, CP, interleave, PP 1, Mooncake, index_kpool, layer split, page
64) and of the rest of the gate stays upstream's. Flag off: upstream's function, called as is.

The same gate's storage rule (L3 under the flag) is lifted by the resolution step around
the gate, ``gate_view.storage_hidden_from_gate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from sglang_cp_hicache.core.field_overlay import FieldOverlay, constant
from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError

logger = logging.getLogger(__name__)

DSA_SHARD_PAGE_SIZE = 64  # the only DSA page size (and the one upstream's gate requires)
HOPPER_SM_MAJOR = 9


@dataclass(frozen=True)
class DsaShardBackends:
    """The DSA sub-backends and KV format a sharded prefill rank reads its tables with."""

    prefill: Optional[str]
    decode: Optional[str]
    kv_cache_dtype: str
    page_size: Optional[int]

    @classmethod
    def of(cls, cfg: Any) -> "DsaShardBackends":
        return cls(
            cfg.dsa_prefill_backend, cfg.dsa_decode_backend, cfg.kv_cache_dtype, cfg.page_size
        )

    def spelled(self) -> str:
        return (
            f"--dsa-prefill-backend {self.prefill} --dsa-decode-backend {self.decode} "
            f"--kv-cache-dtype {self.kv_cache_dtype} --page-size {self.page_size}"
        )


#: What upstream's backend rule admits on every CUDA GPU (kv_shard_hook.py:45-54).
UPSTREAM_ADMITTED = DsaShardBackends("trtllm", "trtllm", "fp8_e4m3", DSA_SHARD_PAGE_SIZE)

#: What the plugin adds, per SM major: the two formats an H200 resolves by default
#: (overrides.py:714-726), each with the decode backend it resolves with them (a PD prefill
#: worker runs no decode batch; the MTP draft's extend reads with the prefill kernel).
ADMITTED = {
    HOPPER_SM_MAJOR: (
        # token-level indices (page_table_1) over bf16 KV rows
        DsaShardBackends("flashmla_sparse", "fa3", "bfloat16", DSA_SHARD_PAGE_SIZE),
        # the packed fp8 rows (656 bytes per token) read through 64-token blocks
        DsaShardBackends("flashmla_kv", "flashmla_kv", "fp8_e4m3", DSA_SHARD_PAGE_SIZE),
    ),
}


def admitted_on(sm_major: int) -> Tuple[DsaShardBackends, ...]:
    """Every triple a sharded DSA prefill rank on SM ``sm_major`` may run, upstream's first."""
    return (UPSTREAM_ADMITTED,) + ADMITTED.get(sm_major, ())


# Upstream's admitted backend triple, shown to its check in place of an admitted resolved one.
_UPSTREAM_TRIPLE = {
    "dsa_prefill_backend": constant(UPSTREAM_ADMITTED.prefill),
    "dsa_decode_backend": constant(UPSTREAM_ADMITTED.decode),
    "kv_cache_dtype": constant(UPSTREAM_ADMITTED.kv_cache_dtype),
}


def _device_sm_major() -> int:
    """The GPU's SM major, read where upstream's DSA resolution reads it (overrides.py)."""
    import torch

    return torch.cuda.get_device_capability()[0]


def _refusal(chosen: DsaShardBackends, sm_major: int) -> CpSharedKVConfigError:
    admitted = "; or ".join(b.spelled() for b in admitted_on(sm_major))
    hopper = "; or ".join(b.spelled() for b in ADMITTED[HOPPER_SM_MAJOR])
    return CpSharedKVConfigError(
        f"{CLI_FLAG}: DSA KV sharding on SM{sm_major}0 admits {admitted} (got "
        f"{chosen.spelled()}). The plugin adds, on Hopper (SM90) only, {hopper}: the "
        "formats whose scratch-translated tables are checked against the replicated pool."
    )


def validate_dsa_backend_around(
    original: Callable[..., None], server_args: Any, cfg: Any = None
) -> None:
    """AROUND ``kv_shard_hook.validate_kv_shard_attention_backend(server_args, cfg)``."""
    if not cp_mode(server_args).shards_kv:
        return original(server_args, cfg)
    from sglang.srt.arg_groups.overrides import (
        attention_backends_of,
        resolved_view,
        resolving_view,
    )

    cfg = cfg or resolving_view(server_args)
    prefill_backend, _ = attention_backends_of(resolved_view(server_args))
    if prefill_backend != "dsa" or cfg.device != "cuda":
        # Not the DSA backend rule (our model step refuses non-DSA models), or upstream's
        # CUDA rule refuses first: upstream's verdict, unchanged.
        return original(server_args, cfg)
    chosen, sm_major = DsaShardBackends.of(cfg), _device_sm_major()
    if chosen == UPSTREAM_ADMITTED:
        return original(server_args, cfg)
    if chosen not in ADMITTED.get(sm_major, ()):
        raise _refusal(chosen, sm_major)
    logger.info(
        "%s: admitting DSA KV sharding with %s on SM%d0", CLI_FLAG, chosen.spelled(), sm_major
    )
    return original(server_args, FieldOverlay(cfg, _UPSTREAM_TRIPLE))
