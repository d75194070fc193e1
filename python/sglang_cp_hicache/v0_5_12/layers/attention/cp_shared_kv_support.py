"""Serving modes the CP shared-KV attention runtime covers, checked at startup.

The runtime materialises prefix KV for EXTEND batches of the NSA backend's sparse MLA
prefill paths. Anything that would read KV pages outside that path is refused here with
a reason, rather than silently reading pages this rank does not hold (speculative decoding
is checked with the flag, :func:`sglang_cp_hicache.v0_5_12.server_args.unsupported_combinations`:
the NSA MTP draft's prefill extend is an EXTEND batch of the same runtime):

* co-located decode (decode reads the whole KV every step; run the decode side as a
  separate ``--disaggregation-mode decode`` server, which receives the full KV);
* PD transfer through a backend other than Mooncake, or with only CP rank 0 sending;
* two-batch overlap, PD multiplexing (split prefill), enforced piecewise CUDA graphs;
* NSA prefill kernels whose KV path the runtime does not wrap.
"""

from __future__ import annotations

from typing import Any, List

from sglang_cp_hicache.v0_5_12.server_args import CLI_FLAG

SUPPORTED_NSA_PREFILL_BACKENDS = (None, "flashmla_sparse", "flashmla_kv", "flashmla_auto", "fa3")
ALL_CP_RANKS_TRANSFER_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"


def _all_cp_ranks_transfer_enabled() -> bool:
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get())


def unsupported_serving_modes(server_args: Any) -> List[str]:
    """Every reason ``server_args`` cannot serve with CP shared KV attention (empty if it can).

    Meant for server-args validation when ``--enable-nsa-prefill-cp-shared-kv`` is on.
    """
    problems: List[str] = []
    mode = getattr(server_args, "disaggregation_mode", "null")
    if mode != "prefill":
        problems.append(
            f"{CLI_FLAG} serves only as the prefill side of PD disaggregation "
            f"(--disaggregation-mode prefill), got {mode!r}: decode reads every KV page each "
            "step, which a shared-KV rank does not hold; run decode as a separate "
            "--disaggregation-mode decode server, which receives the full KV"
        )
    else:
        backend = getattr(server_args, "disaggregation_transfer_backend", "mooncake")
        if backend != "mooncake":
            problems.append(
                f"{CLI_FLAG} sends each CP rank's owned KV and indexer pages through the "
                f"Mooncake backend only, got --disaggregation-transfer-backend {backend!r}"
            )
        if not _all_cp_ranks_transfer_enabled():
            problems.append(
                f"{CLI_FLAG} needs {ALL_CP_RANKS_TRANSFER_ENV}=1 on the prefill and the decode "
                "servers: every CP rank sends the pages it owns (otherwise only CP rank 0 "
                "sends, and it holds 1/cp_size of the pages)"
            )
    if getattr(server_args, "enable_two_batch_overlap", False):
        problems.append(f"{CLI_FLAG} does not support --enable-two-batch-overlap")
    if getattr(server_args, "enable_pdmux", False):
        problems.append(f"{CLI_FLAG} does not support --enable-pdmux (split prefill)")
    if getattr(server_args, "enforce_piecewise_cuda_graph", False):
        problems.append(f"{CLI_FLAG} does not support --enforce-piecewise-cuda-graph")
    prefill_backend = getattr(server_args, "nsa_prefill_backend", None)
    if prefill_backend not in SUPPORTED_NSA_PREFILL_BACKENDS:
        problems.append(
            f"{CLI_FLAG} supports --nsa-prefill-backend "
            f"{', '.join(b for b in SUPPORTED_NSA_PREFILL_BACKENDS if b)} (or auto), "
            f"got {prefill_backend!r}"
        )
    return problems
