"""Device memory for the dense buffers in flight, reserved out of the KV budget at init.

A forward materialises its prefix one layer at a time, with the next layer prefetched, so
at most ``LAYERS_IN_FLIGHT`` dense buffers (plus, for the all-gather, one send slab and the
receive buffer) are alive. Their size follows the largest prefix a forward may materialise
(``max_prefix_tokens``, the model's context length: a batch's prefix + chunk pages). That many bytes are taken
out of SGLang's KV budget before the pools are sized (AROUND
``ModelRunnerKVCacheMixin._profile_available_bytes``) and logged. Prefill admission
(:mod:`sglang_cp_hicache.v0_5_12.managers.schedule_policy`) keeps every batch within
:attr:`DenseBufferBudget.max_batch_pages`; :meth:`DenseBufferBudget.check_batch` in the
forward is the fail-fast for anything that slips past, before any dense buffer is
allocated, never an OOM in the middle of the layer loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

LAYERS_IN_FLIGHT = 2  # the layer being computed + the prefetched next one
INDEX_BYTES_PER_TOKEN = 128 + 4  # fp8 index K + fp32 scale
FP8_KV_BYTES_PER_TOKEN = 656
BUDGET_ATTR = "cp_shared_kv_dense_budget"
_active_budget: "Optional[DenseBufferBudget]" = None


class SharedKVBudgetExceeded(RuntimeError):
    """A batch's prefix is larger than the dense-buffer memory reserved at init."""


@dataclass(frozen=True)
class DenseBufferBudget:
    """Bytes reserved per rank for dense buffers; ``max_prefix_tokens`` bounds a batch.

    Invariant: ``reserved_bytes`` covers ``LAYERS_IN_FLIGHT`` dense buffers of
    ``max_prefix_tokens`` plus the all-gather's send slab and receive buffer.
    """

    max_prefix_tokens: int
    bytes_per_token: int  # one layer: MLA latent + index K/scale
    page_size: int
    cp_size: int

    @property
    def max_batch_pages(self) -> int:
        """Distinct KV pages one forward may read (the dense buffer less its padding page).

        A request of at most ``max_prefix_tokens`` tokens spans at most this many pages.
        """
        return -(-self.max_prefix_tokens // self.page_size)

    @property
    def dense_buffer_bytes(self) -> int:
        pages = self.max_batch_pages + 1  # + padding page
        return pages * self.page_size * self.bytes_per_token

    @property
    def all_gather_staging_bytes(self) -> int:
        owned = -(-self.dense_buffer_bytes // self.cp_size)
        return owned * (1 + self.cp_size)  # send slab + receive buffer (cp slabs)

    @property
    def reserved_bytes(self) -> int:
        return LAYERS_IN_FLIGHT * self.dense_buffer_bytes + self.all_gather_staging_bytes

    def check_batch(self, num_batch_pages: int) -> None:
        """Fail fast in the forward if a batch reads more pages than reserved.

        ``num_batch_pages``: the batch's distinct KV pages (the dense buffer, less padding).
        Unreachable through SGLang's scheduler: admission bounds every batch first.
        """
        if num_batch_pages > self.max_batch_pages:
            raise SharedKVBudgetExceeded(
                f"--enable-nsa-prefill-cp-shared-kv: this batch reads {num_batch_pages} KV pages "
                f"per layer, more than the {self.max_batch_pages} ({self.max_prefix_tokens} tokens) "
                f"the dense buffers were reserved for at init ({self.reserved_bytes / 2**20:.0f} MiB); "
                "prefill admission should have deferred part of it; refusing the batch before allocating"
            )


def kv_bytes_per_token(model_runner: Any) -> int:
    """One layer's bytes per token in the NSA pool: latent row + index K/scale."""
    import torch

    config = model_runner.model_config
    fp8 = model_runner.kv_cache_dtype in (torch.float8_e4m3fn, torch.uint8)
    latent = FP8_KV_BYTES_PER_TOKEN if fp8 else 2 * (config.kv_lora_rank + config.qk_rope_head_dim)
    return latent + INDEX_BYTES_PER_TOKEN


def active_budget() -> Optional[DenseBufferBudget]:
    """The budget reserved at init in this process (``None`` before, or with the flag off)."""
    return _active_budget


def budget_for(model_runner: Any, cp_size: int) -> DenseBufferBudget:
    return DenseBufferBudget(
        max_prefix_tokens=int(model_runner.model_config.context_len),
        bytes_per_token=kv_bytes_per_token(model_runner),
        page_size=int(model_runner.page_size),
        cp_size=cp_size,
    )


def profile_available_bytes_around(original: Callable, self: Any, *args, **kwargs) -> int:
    """AROUND ``_profile_available_bytes``: the KV budget minus the dense buffers' bytes."""
    available = original(self, *args, **kwargs)
    from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled

    if not is_cp_shared_kv_enabled(self.server_args) or getattr(self, "is_draft_worker", False):
        return available
    from sglang.srt.layers.dp_attention import get_attention_cp_size

    budget = budget_for(self, get_attention_cp_size())
    if budget.reserved_bytes >= available:
        raise SharedKVBudgetExceeded(
            f"--enable-nsa-prefill-cp-shared-kv: the dense buffers for a {budget.max_prefix_tokens}-token "
            f"prefix need {budget.reserved_bytes / 2**30:.2f} GiB, more than the "
            f"{available / 2**30:.2f} GiB KV budget; lower --context-length or raise --mem-fraction-static"
        )
    global _active_budget
    setattr(self, BUDGET_ATTR, budget)
    _active_budget = budget
    logger.info(
        "CP shared KV: reserved %.1f MiB of the %.1f GiB KV budget for dense buffers "
        "(%d layers in flight + all-gather staging, prefix up to %d tokens, %d B/token/layer)",
        budget.reserved_bytes / 2**20, available / 2**30, LAYERS_IN_FLIGHT,
        budget.max_prefix_tokens, budget.bytes_per_token,
    )
    return available - budget.reserved_bytes
