"""Hook glue: targets exist with compatible signatures; scopes restore; guards fire."""

import inspect
import pkgutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_cp_hicache.v0_5_12.hooks import HOOKS as PLUGIN_HOOKS, resolve
from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import build_batch_mapping
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

ALL_SPECS = [
    (spec.dotted_target, resolve(spec.hook), spec.hook_type)
    for spec in PLUGIN_HOOKS
    if spec.hook.startswith(("sglang_cp_hicache.v0_5_12.layers.", "sglang_cp_hicache.v0_5_12.disaggregation."))
]


def _installed_original(target):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    return inspect.unwrap(original)


@pytest.mark.parametrize("target,hook,hook_type", ALL_SPECS, ids=[s[0].rsplit(".", 2)[-2] + "." + s[0].rsplit(".", 1)[-1] for s in ALL_SPECS])
def test_hook_targets_exist_and_accept_the_originals_arguments(target, hook, hook_type):
    assert hook_type == "AROUND"
    original = _installed_original(target)
    params = list(inspect.signature(original).parameters.values())
    hook_sig = inspect.signature(hook)
    positional = [object() for p in params if p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
    hook_sig.bind(original, *positional)
    keyword = {p.name: object() for p in params[len(positional):] if p.kind == p.POSITIONAL_OR_KEYWORD}
    hook_sig.bind(original, *positional, **keyword)


def test_swap_attributes_restores_on_error():
    obj = SimpleNamespace(a=1, b=2)
    with pytest.raises(RuntimeError):
        with hooks.swap_attributes(obj, a=10):
            assert obj.a == 10
            raise RuntimeError
    assert (obj.a, obj.b) == (1, 2)


def _nsa_metadata(page_table):
    from sglang.srt.layers.attention.nsa_backend import NSAMetadata

    zeros = torch.zeros(2, dtype=torch.int32)
    return NSAMetadata(
        page_size=4, cache_seqlens_int32=zeros, max_seq_len_q=1, max_seq_len_k=8,
        cu_seqlens_q=zeros, cu_seqlens_k=zeros, page_table_1=page_table,
        real_page_table=page_table[:, ::4] // 4, nsa_cache_seqlens_int32=zeros,
        nsa_cu_seqlens_q=zeros, nsa_cu_seqlens_k=zeros, nsa_extend_seq_lens_list=[1, 1],
        nsa_seqlens_expanded=zeros, page_table_1_flattened=page_table.flatten(),
    )


def test_remap_nsa_metadata_rewrites_only_the_page_tables_of_sglangs_metadata():
    mapping = build_batch_mapping(CpSharedKVLayout(2, 0, 4), [np.array([10, 3]), np.array([6])], [5, 0], "cpu")
    page_table = torch.tensor([[40, 41, 42, 43, 12, 13, 14, 15], [24, 25, 26, 99, 99, 99, 99, 99]], dtype=torch.int32)
    metadata = _nsa_metadata(page_table)
    dense = hooks.remap_nsa_metadata(metadata, mapping)
    # dense pages: prefix of owner 0 (10) -> 1, of owner 1 (3) -> 2, chunk-only 6 -> 3;
    # page 24 (stale, loc 99) -> padding page 0
    assert dense.page_table_1.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 3, 3, 3, 3, 3]]
    assert dense.real_page_table.tolist() == [[1, 2], [3, 0]]
    assert dense.page_table_1_flattened.tolist() == dense.page_table_1.flatten().tolist()
    assert dense.page_table_1.dtype == torch.int32
    assert dense.cache_seqlens_int32 is metadata.cache_seqlens_int32


def test_logical_capacity_view_changes_size_only():
    pool = SimpleNamespace(size=64, page_size=4)
    view = hooks.logical_capacity_view(pool, 256)
    assert (view.size, view.page_size, pool.size) == (256, 4, 64)


def _batch(mode_name):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode[mode_name], batch_size=2)


def test_only_extend_batches_reach_the_read_path():
    assert hooks._is_shared_kv_extend(_batch("EXTEND"))
    assert not hooks._is_shared_kv_extend(_batch("IDLE"))
    for mode in ("DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "MIXED"):
        with pytest.raises(hooks.SharedKVUnsupportedPath, match=mode):
            hooks._is_shared_kv_extend(_batch(mode))


def test_dummy_decode_runs_pass_through_but_real_decode_is_refused():
    def dummy_run(runner):
        return hooks._is_shared_kv_extend(_batch("DECODE"))

    assert hooks.dummy_run_around(dummy_run, object()) is False
    assert not hooks.in_dummy_run()
    with pytest.raises(hooks.SharedKVUnsupportedPath, match="DECODE"):
        hooks._is_shared_kv_extend(_batch("DECODE"))
    with pytest.raises(hooks.SharedKVUnsupportedPath, match="TARGET_VERIFY"):
        hooks.dummy_run_around(lambda runner: hooks._is_shared_kv_extend(_batch("TARGET_VERIFY")), object())


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_logical_capacity_covers_the_highest_logical_loc(cp_size):
    """SGLang bounds locs by ``size + page_size``; the top lane's last page must fit."""
    page = 64
    pool = SimpleNamespace(size=10 * page, page_size=page)
    layout = CpSharedKVLayout(cp_size, cp_size - 1, page)
    highest_physical_loc = pool.size + page - 1  # physical pages 0 (padding) .. 10
    highest_logical = int(layout.physical_locs_to_logical(np.array([highest_physical_loc]))[0])
    capacity = hooks.logical_capacity_size(pool, layout) + page
    assert highest_logical == cp_size * (pool.size + page) - 1
    assert highest_logical < capacity
    assert capacity == cp_size * (pool.size + page)


def test_hooks_pass_through_when_shared_kv_is_off():
    backend = SimpleNamespace(**{hooks.RUNTIME_ATTR: None})
    batch = _batch("DECODE")
    calls = []
    hooks.init_forward_metadata_around(lambda self, fb: calls.append("init"), backend, batch)
    assert calls == ["init"] and not hasattr(batch, hooks.STATE_ATTR)
    batch.token_to_kv_pool = SimpleNamespace(start_layer=0)  # no layer-backup listener
    layer = SimpleNamespace(layer_id=0)
    out = hooks.forward_extend_around(lambda *a, **kw: kw, None, 1, 2, 3, layer, batch, save_kv_cache=False, k_rope=4)
    assert out == {"save_kv_cache": False, "k_rope": 4}


def test_attention_outside_the_hooked_model_forward_is_refused():
    state = SimpleNamespace(pipeline=None)
    batch = SimpleNamespace(**{hooks.STATE_ATTR: state})
    with pytest.raises(hooks.SharedKVUnsupportedPath, match="outside the hooked model forward"):
        hooks.active_state(batch)


def test_fused_rope_cache_path_is_refused():
    state = SimpleNamespace(pipeline=object())
    batch = SimpleNamespace(**{hooks.STATE_ATTR: state})
    with pytest.raises(hooks.SharedKVUnsupportedPath, match="fused rope"):
        hooks.forward_extend_around(None, None, 1, None, None, SimpleNamespace(layer_id=0), batch)


class _Activated(Exception):
    pass


@pytest.mark.parametrize(
    "model_cls",
    [
        "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM",  # DeepSeek-V3.2, GLM-5 targets
        "sglang.srt.models.deepseek_nextn:DeepseekV3ForCausalLMNextN",  # their MTP drafts
    ],
)
def test_target_and_draft_model_forwards_activate_the_shared_kv_state(plugins_loaded, model_cls):
    # The draft class overrides forward, so it needs its own hook: without it the draft's
    # attention finds no active pipeline and is refused.
    cls = resolve(model_cls)

    class State:
        def activate(self, forward_batch):
            raise _Activated

    batch = SimpleNamespace(token_to_kv_pool=None, **{hooks.STATE_ATTR: State()})
    with pytest.raises(_Activated):
        cls.forward(SimpleNamespace(), torch.zeros(1), torch.zeros(1), batch)
    assert getattr(batch, hooks.STATE_ATTR) is None  # consumed by this forward
