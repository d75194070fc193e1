"""CP shared KV inside SGLang's NSA attention: the AROUND hooks and the state they share.

Per forward (extend batches only):

1. ``NativeSparseAttnBackend.init_forward_metadata`` (:func:`init_forward_metadata_around`):
   after SGLang builds its metadata from the logical ``req_to_token``, build one
   :class:`CpSharedKVForwardState`: the write-path locs, the batch's dense page mapping,
   the dense-remapped copy of the metadata, the current chunk's dense locs.
2. ``DeepseekV2ForCausalLM.forward`` (:func:`model_forward_around`, GLM-5 inherits it):
   for the duration of the model forward, ``forward_batch.out_cache_loc`` holds the
   *physical* write locs, and a :class:`LayerMaterializationPipeline` serves per-layer
   dense buffers; the logical locs are restored before SGLang's post-forward consumers.
3. Per layer, the indexer (``Indexer.forward_cuda``) and the attention
   (``NativeSparseAttnBackend.forward_extend``) run inside a *dense scope*: the forward
   batch sees a shallow view of the pool whose layer buffers are the dense ones, dense
   ``out_cache_loc`` and dense-remapped metadata. So SGLang's own writers put the current
   chunk (already gathered by prefill CP) into the dense buffer and its own readers and
   kernels read prefix + chunk from it. The owned part of the chunk is written to the
   real pool first, at physical locs (``Indexer._store_index_k_cache`` and the MLA store).
4. At each layer's end (after the extend attention returns, so after its KV and index K
   stores are issued) the pool's per-layer backup listener hears of it
   (:mod:`sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup`), and again when the model forward
   returns or raises. Both run with shared KV on or off (a pool with no listener: one
   dict lookup).

Flag off means upstream: the runtime resolves from the flag (None unless it is a real
``True``), and the per-forward state and the layer listener are found only where the plugin
stored them, in the forward batch's and the pool's own ``__dict__`` (:func:`plugin_attr`), so a
batch or pool that answers every name (a ``MagicMock``) is never taken for one that has them.

Everything but the thin hook functions is plain torch and runs in the CPU twin.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import (
    DenseBufferBudget,
    active_budget,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_collectives import (
    create_materialize_group,
    materialize_choice,
    materialize_group,
    resolve_strategy,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import (
    CpSharedKVBatchMapping,
    build_batch_mapping,
    forward_logical_pages,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import (
    DenseLayerKV,
    LayerMaterializationPipeline,
    PoolPageReader,
    make_strategy,
    prefetch_from_env,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_write import WritePathLocs
from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.v0_5_12.own_objects import plugin_attr

logger = logging.getLogger(__name__)

STATE_ATTR = "cp_shared_kv_state"
RUNTIME_ATTR = "_cp_shared_kv_runtime"
_NOT_RESOLVED = object()
_dummy_run_scope = threading.local()


class SharedKVUnsupportedPath(RuntimeError):
    """A forward took a path that the shared-KV read path does not cover; never silent."""


@contextlib.contextmanager
def swap_attributes(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of the block, then restore the previous values."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def dense_pool_view(pool: Any, layer_id: int, dense: DenseLayerKV) -> Any:
    """Shallow copy of ``pool`` whose buffers for ``layer_id`` are the dense ones.

    The real pool is never mutated, so other readers of it (HiCache backup and load
    kernels, the next layer) are unaffected. Every pool method works on the view.
    """
    view = copy.copy(pool)
    index = layer_id - pool.start_layer
    view.kv_buffer = list(pool.kv_buffer)
    view.kv_buffer[index] = dense.kv_buffer
    view.index_k_with_scale_buffer = list(pool.index_k_with_scale_buffer)
    view.index_k_with_scale_buffer[index] = dense.index_buffer
    return view


def logical_capacity_size(pool: Any, layout: CpSharedKVLayout) -> int:
    """``size`` the logical view of ``pool`` reports.

    SGLang bounds page-table entries by ``size + page_size`` (RAGGED top-k / MHA dequant
    with prefix sharing). Logical locs reach ``cp * (size + page) - 1`` because every lane
    keeps a padding page, so the view reports ``cp * (size + page) - page``.
    """
    return layout.cp_size * (pool.size + layout.page_size) - layout.page_size


def logical_capacity_view(pool: Any, logical_size: int) -> Any:
    """Shallow copy of ``pool`` reporting the logical capacity ``logical_size``."""
    view = copy.copy(pool)
    view.size = logical_size
    return view


def remap_nsa_metadata(metadata: Any, mapping: CpSharedKVBatchMapping) -> Any:
    """Copy of the backend metadata whose page tables address the dense buffer."""
    changes = {
        "page_table_1": mapping.remap_logical_locs(metadata.page_table_1),
        "real_page_table": mapping.remap_logical_pages(metadata.real_page_table),
    }
    if metadata.page_table_1_flattened is not None:
        changes["page_table_1_flattened"] = mapping.remap_logical_locs(metadata.page_table_1_flattened)
    return dataclasses.replace(metadata, **changes)


@dataclass
class CpSharedKVRuntime:
    """Per-model-runner settings: layout, CP group, materialise strategy, prefetch."""

    layout: CpSharedKVLayout
    group: Any
    strategy: str
    prefetch: bool = True
    side_stream: Optional[torch.cuda.Stream] = None
    budget: Optional[DenseBufferBudget] = None  # dense-buffer memory reserved at init

    @classmethod
    def from_sglang(cls, page_size: int) -> Optional["CpSharedKVRuntime"]:
        """From SGLang's globals; ``None`` when ``--enable-nsa-prefill-cp-shared-kv`` is off."""
        from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size
        from sglang.srt.server_args import get_global_server_args

        from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled

        server_args = get_global_server_args()
        if not is_cp_shared_kv_enabled(server_args):
            return None
        layout = CpSharedKVLayout(get_attention_cp_size(), get_attention_cp_rank(), page_size)
        group = materialize_group()  # own communicator, same ranks as the attention CP group
        runtime = cls(
            layout=layout,
            group=group,
            strategy=resolve_strategy(materialize_choice(server_args), torch.distributed.get_backend(group)),
            prefetch=prefetch_from_env(),
            side_stream=torch.cuda.Stream() if torch.cuda.is_available() else None,
            budget=active_budget(),
        )
        logger.info(
            "CP shared KV attention: rank %d/%d, materialise=%s, prefetch=%s",
            layout.cp_rank,
            layout.cp_size,
            runtime.strategy,
            runtime.prefetch,
        )
        return runtime


def runtime_for(backend: Any) -> Optional[CpSharedKVRuntime]:
    """The backend's runtime, resolved once (an explicit one set on it wins)."""
    runtime = backend.__dict__.get(RUNTIME_ATTR, _NOT_RESOLVED)
    if runtime is _NOT_RESOLVED:
        runtime = CpSharedKVRuntime.from_sglang(backend.real_page_size)
        setattr(backend, RUNTIME_ATTR, runtime)
    return runtime


@dataclass
class CpSharedKVForwardState:
    """What one forward batch needs under shared KV; built once, used by every layer.

    Invariants: ``write_locs.logical`` is the batch's original ``out_cache_loc``;
    ``dense_metadata`` differs from ``logical_metadata`` only in its page tables;
    ``pipeline`` is set exactly while the model forward runs (:meth:`activate`).
    """

    runtime: CpSharedKVRuntime
    backend: Any
    pool: Any
    write_locs: WritePathLocs
    mapping: CpSharedKVBatchMapping
    dense_out_cache_loc: torch.Tensor
    logical_metadata: Any
    dense_metadata: Any
    pipeline: Optional[LayerMaterializationPipeline] = None

    @classmethod
    def build(cls, runtime: CpSharedKVRuntime, backend: Any, forward_batch: Any) -> "CpSharedKVForwardState":
        layout = runtime.layout
        logical_pages = forward_logical_pages(forward_batch, layout.page_size)
        mapping = build_batch_mapping(
            layout, logical_pages, forward_batch.extend_prefix_lens_cpu, forward_batch.out_cache_loc.device
        )
        if runtime.budget is not None:  # refuse before any dense buffer is allocated
            runtime.budget.check_batch(mapping.num_dense_pages - 1)
        write_locs = WritePathLocs.build(layout, forward_batch.out_cache_loc)
        metadata = backend.forward_metadata
        return cls(
            runtime=runtime,
            backend=backend,
            pool=forward_batch.token_to_kv_pool,
            write_locs=write_locs,
            mapping=mapping,
            dense_out_cache_loc=mapping.remap_logical_locs(write_locs.logical),
            logical_metadata=metadata,
            dense_metadata=remap_nsa_metadata(metadata, mapping),
        )

    @contextlib.contextmanager
    def activate(self, forward_batch: Any) -> Iterator[None]:
        """The model forward: physical write locs and a fresh per-layer pipeline."""
        runtime = self.runtime
        self.pipeline = LayerMaterializationPipeline(
            strategy=make_strategy(runtime.strategy, runtime.group),
            mapping=self.mapping,
            reader=PoolPageReader(self.pool),
            end_layer=self.pool.start_layer + len(self.pool.kv_buffer),
            prefetch=runtime.prefetch,
            side_stream=runtime.side_stream,
        )
        try:
            with swap_attributes(forward_batch, out_cache_loc=self.write_locs.physical):
                yield
        finally:
            self.pipeline.close()
            self.pipeline = None

    @contextlib.contextmanager
    def dense_scope(self, forward_batch: Any, layer_id: int) -> Iterator[DenseLayerKV]:
        """Pool, write locs and metadata of ``layer_id`` all address the dense buffer."""
        dense = self.pipeline.get(layer_id)
        view = dense_pool_view(self.pool, layer_id, dense)
        with swap_attributes(
            forward_batch, token_to_kv_pool=view, out_cache_loc=self.dense_out_cache_loc
        ), swap_attributes(self.backend, forward_metadata=self.dense_metadata):
            yield dense

    @contextlib.contextmanager
    def pool_scope(self, forward_batch: Any) -> Iterator[None]:
        """The real pool, physical write locs and logical metadata (owned writes)."""
        with swap_attributes(
            forward_batch, token_to_kv_pool=self.pool, out_cache_loc=self.write_locs.physical
        ), swap_attributes(self.backend, forward_metadata=self.logical_metadata):
            yield


def _is_shared_kv_extend(forward_batch: Any) -> bool:
    """True for the batches the read path covers; raise for the ones it must not see."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = forward_batch.forward_mode
    if mode == ForwardMode.EXTEND:
        return forward_batch.batch_size > 0
    if mode == ForwardMode.IDLE:
        return False
    if mode == ForwardMode.DECODE and in_dummy_run():
        # Warm-up / autotune: buffers of zeros, every loc on the padding page, outputs
        # discarded. Nothing reads a page this rank does not hold.
        _warn_dummy_decode_once()
        return False
    raise SharedKVUnsupportedPath(
        f"--enable-nsa-prefill-cp-shared-kv: forward mode {mode.name} would read KV pages "
        "this rank does not hold; only EXTEND batches (disaggregated prefill) are supported"
    )


def active_state(forward_batch: Any) -> Optional[CpSharedKVForwardState]:
    """The batch's state while its model forward runs; ``None`` when shared KV is off."""
    state = plugin_attr(forward_batch, STATE_ATTR)
    if state is None:
        return None
    if state.pipeline is None:
        raise SharedKVUnsupportedPath(
            "--enable-nsa-prefill-cp-shared-kv: NSA attention ran outside the hooked model "
            "forward (DeepseekV2ForCausalLM.forward), so the prefix KV was not materialised"
        )
    return state


def in_dummy_run() -> bool:
    """True inside ``ModelRunner._dummy_run`` (warm-up / FlashInfer autotune)."""
    return getattr(_dummy_run_scope, "depth", 0) > 0


@contextlib.contextmanager
def dummy_run_scope() -> Iterator[None]:
    _dummy_run_scope.depth = getattr(_dummy_run_scope, "depth", 0) + 1
    try:
        yield
    finally:
        _dummy_run_scope.depth -= 1


_warned_dummy_decode = False


def _warn_dummy_decode_once() -> None:
    global _warned_dummy_decode
    if not _warned_dummy_decode:
        _warned_dummy_decode = True
        logger.warning(
            "CP shared KV: a warm-up/autotune dummy DECODE run passes through unmodified "
            "(its locs are all on the padding page); real DECODE batches are refused"
        )


def startup_runtime(model_runner: Any) -> Optional[CpSharedKVRuntime]:
    """At init, every rank: the dedicated materialisation group (a world collective), then
    the runtime the NSA backend will resolve. ``None`` when the flag is off."""
    from sglang.srt.layers.dp_attention import get_attention_cp_group

    from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled

    if not is_cp_shared_kv_enabled(model_runner.server_args):
        return None
    create_materialize_group(get_attention_cp_group().ranks)
    return CpSharedKVRuntime.from_sglang(model_runner.token_to_kv_pool.page_size)


# ------------------------------------------------------------------------- hooks
def dummy_run_around(original: Callable, self: Any, *args, **kwargs) -> Any:
    with dummy_run_scope():
        return original(self, *args, **kwargs)


def init_forward_metadata_around(original: Callable, self: Any, forward_batch: Any) -> Any:
    runtime = runtime_for(self)
    if runtime is None:
        return original(self, forward_batch)
    setattr(forward_batch, STATE_ATTR, None)
    if not _is_shared_kv_extend(forward_batch):
        return original(self, forward_batch)
    pool = forward_batch.token_to_kv_pool
    logical_size = logical_capacity_size(pool, runtime.layout)
    with swap_attributes(forward_batch, token_to_kv_pool=logical_capacity_view(pool, logical_size)):
        result = original(self, forward_batch)
    setattr(forward_batch, STATE_ATTR, CpSharedKVForwardState.build(runtime, self, forward_batch))
    return result


def model_forward_around(original: Callable, self: Any, input_ids, positions, forward_batch, *args, **kwargs):
    pool = forward_batch.token_to_kv_pool
    try:
        result = _model_forward(original, self, input_ids, positions, forward_batch, *args, **kwargs)
    except BaseException as error:
        cp_layer_backup.notify_forward_end(pool, error)
        raise
    cp_layer_backup.notify_forward_end(pool)
    return result


def _model_forward(original: Callable, self: Any, input_ids, positions, forward_batch, *args, **kwargs):
    state = plugin_attr(forward_batch, STATE_ATTR)
    if state is None:
        return original(self, input_ids, positions, forward_batch, *args, **kwargs)
    try:
        with state.activate(forward_batch):
            return original(self, input_ids, positions, forward_batch, *args, **kwargs)
    finally:
        setattr(forward_batch, STATE_ATTR, None)


def forward_extend_around(
    original: Callable, self: Any, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs
):
    output = _forward_extend(original, self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    # Layer end: this layer's MLA KV store (above or in the original) and its index K store
    # (by the indexer, which runs before the attention) are issued on the forward's stream.
    cp_layer_backup.notify_layer_stored(forward_batch.token_to_kv_pool, layer.layer_id)
    return output


def _forward_extend(original: Callable, self: Any, q, k, v, layer, forward_batch, save_kv_cache: bool, **kwargs):
    state = active_state(forward_batch)
    if state is None:
        return original(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    if k is None:
        raise SharedKVUnsupportedPath(
            "--enable-nsa-prefill-cp-shared-kv: the fused rope+cache MLA path passes no K to "
            "the attention backend, so the current chunk cannot be placed in the dense buffer"
        )
    if save_kv_cache:  # owned tokens -> this rank's pool (physical locs, non-owned -> padding)
        with state.pool_scope(forward_batch):
            forward_batch.token_to_kv_pool.set_mla_kv_buffer(
                layer, forward_batch.out_cache_loc, k, kwargs.get("k_rope")
            )
    with state.dense_scope(forward_batch, layer.layer_id):
        return original(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs)


def indexer_forward_around(original: Callable, self: Any, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs):
    state = active_state(forward_batch)
    if state is None:
        return original(self, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs)
    with state.dense_scope(forward_batch, layer_id):
        return original(self, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs)


def store_index_k_cache_around(original: Callable, self: Any, forward_batch, layer_id, key, **kwargs) -> None:
    state = active_state(forward_batch)
    if state is None:
        return original(self, forward_batch, layer_id, key, **kwargs)
    with state.pool_scope(forward_batch):
        original(self, forward_batch, layer_id, key, **kwargs)
    with state.dense_scope(forward_batch, layer_id):
        original(self, forward_batch, layer_id, key, **kwargs)
    return None
