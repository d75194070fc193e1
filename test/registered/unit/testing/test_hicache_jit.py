"""The CPU stand-ins of SGLang 0.5.23's compiled JIT HiCache modules (``testing/hicache_jit.py``):
one layer copied into and out of a per-layer strided view of a ``page_first`` host buffer moves
exactly the bytes a plain copy does, for the three buffers a backup moves (the MLA latent KV,
the DSA indexer's K/scale pages, a packed MTP draft's tail layer); and every rule of the real
kernels refuses a call that breaks only that rule, so a stand-in laxer than the kernel fails
here. Imports no SGLang (runs in both venvs)."""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch

from sglang_cp_hicache.testing import hicache_jit

PAGE = 64
TARGET_LAYERS = 3
DRAFT_LAYERS = 1
LAYERS = TARGET_LAYERS + DRAFT_LAYERS  # packed MTP: the draft is the host's tail layer
MLA_DIM = 576  # kv_lora_rank 512 + rope 64, bf16: 1152-byte rows
FP8_MLA_BYTES = 656  # DSA FP8 latent rows (uint8 view)
INDEXER_PAGE_BYTES = PAGE * (128 + 4)  # SetKAndS: 64 FP8 keys of 128 B, then 64 fp32 scales


def _register(element_size: int, unroll: int) -> hicache_jit.RegisterModule:
    return hicache_jit.register_module(element_size=element_size, unroll=unroll, block_quota=2)


def _default_unroll(element_size: int) -> int:
    """``hicache._default_unroll``."""
    return 4 if element_size <= 512 else 2 if element_size <= 1024 else 1


def _page_first(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A host buffer as the MLA / DSA indexer host pools allocate it: ``[rows, layer, 1, D]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, LAYERS, 1, dim * torch.empty((), dtype=dtype).element_size()),
                         generator=g, dtype=torch.uint8).view(dtype)  # fmt: skip


def _layer_view(buffer: torch.Tensor, layer: int) -> torch.Tensor:
    """Upstream's per-layer view (``pool_host/mla.py`` ``data_refs``), flattened as the
    wrapper's ``.view(-1, element_dim)`` does."""
    return buffer.transpose(0, 1)[layer].view(-1, buffer.shape[-1])


def _device_rows(rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (rows, dim * size), generator=g, dtype=torch.uint8).view(dtype)


CASES = {
    # name: (host rows, row dim, dtype, item indices are pages, host layer)
    "mla_bf16_target": (4 * PAGE, MLA_DIM, torch.bfloat16, False, 1),
    "mla_fp8_draft": (4 * PAGE, FP8_MLA_BYTES, torch.uint8, False, TARGET_LAYERS),
    "indexer_target": (5, INDEXER_PAGE_BYTES, torch.uint8, True, 2),
    "indexer_draft": (5, INDEXER_PAGE_BYTES, torch.uint8, True, TARGET_LAYERS),
}


def _indices(is_pages: bool) -> tuple:
    """Device -> host slot pairs: two non-adjacent pages (tokens, or page indices)."""
    if is_pages:
        return torch.tensor([3, 0]), torch.tensor([1, 4])
    device = torch.cat([torch.arange(2 * PAGE, 3 * PAGE), torch.arange(0, PAGE)])
    host = torch.cat([torch.arange(PAGE, 2 * PAGE), torch.arange(3 * PAGE, 4 * PAGE)])
    return device, host


def _modules(element_size: int) -> Dict[str, object]:
    """The kernels the wrapper may pick for this row size on the modelled part."""
    modules = {"tma": hicache_jit.tma_module(block_quota=4)}
    try:
        modules["register"] = _register(element_size, _default_unroll(element_size))
    except RuntimeError:
        pass  # 656 B rows do not tile 128 B groups: TMA only (checked below)
    return modules


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_layer_backup_into_a_page_first_view_writes_exactly_that_layers_slots(case: str) -> None:
    rows, dim, dtype, is_pages, layer = CASES[case]
    element_size = dim * torch.empty((), dtype=dtype).element_size()
    for kernel, module in _modules(element_size).items():
        host = _page_first(rows, dim, dtype, seed=1)
        before = host.clone()
        device = _device_rows(8 if is_pages else 8 * PAGE, dim, dtype, seed=2)
        device_idx, host_idx = _indices(is_pages)
        module.launch_one_mla(_layer_view(host, layer), host_idx, device, device_idx)
        expected = before.clone()
        expected[host_idx, layer, 0] = device[device_idx]  # the plain copy
        assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8)), kernel


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_layer_load_from_a_page_first_view_reads_back_the_same_bytes(case: str) -> None:
    rows, dim, dtype, is_pages, layer = CASES[case]
    element_size = dim * torch.empty((), dtype=dtype).element_size()
    host = _page_first(rows, dim, dtype, seed=3)
    device_idx, host_idx = _indices(is_pages)
    for kernel, module in _modules(element_size).items():
        device = torch.zeros_like(_device_rows(8 if is_pages else 8 * PAGE, dim, dtype, seed=0))
        module.launch_one_mla(device, device_idx, _layer_view(host, layer), host_idx)
        expected = torch.zeros_like(device)
        expected[device_idx] = host[host_idx, layer, 0]
        assert torch.equal(device.view(torch.uint8), expected.view(torch.uint8)), kernel


def test_which_row_sizes_the_register_kernel_builds_for() -> None:
    # CUDA tiles 128-byte groups only: bf16 latent rows and the indexer's pages build,
    # the DSA FP8 latent row (656 B) needs the TMA kernel.
    _register(2 * MLA_DIM, _default_unroll(2 * MLA_DIM))
    _register(INDEXER_PAGE_BYTES, _default_unroll(INDEXER_PAGE_BYTES))
    with pytest.raises(RuntimeError, match="does not build"):
        _register(FP8_MLA_BYTES, _default_unroll(FP8_MLA_BYTES))


def test_tma_selection_on_the_modelled_part() -> None:
    select = hicache_jit.tma_selector(lambda: True)
    assert select(element_size=FP8_MLA_BYTES, block_quota=4, page_size=PAGE)
    assert select(element_size=2 * MLA_DIM, block_quota=4, page_size=PAGE)
    # indexer items are whole pages: a page size of 1 item does not tile a 2-row chunk
    assert hicache_jit.tma_rows_per_chunk(INDEXER_PAGE_BYTES) == 2
    assert not select(element_size=INDEXER_PAGE_BYTES, block_quota=4, page_size=1)
    assert select(element_size=INDEXER_PAGE_BYTES, block_quota=4, page_size=None)
    assert not select(element_size=40, block_quota=4, page_size=PAGE)
    assert not hicache_jit.tma_selector(lambda: False)(element_size=FP8_MLA_BYTES, block_quota=4, page_size=PAGE)


# ---- strictness: one valid call, then each rule broken alone ---------------------------

ELEMENT = 2 * MLA_DIM


def _valid_call() -> dict:
    host = _page_first(4 * PAGE, MLA_DIM, torch.bfloat16, seed=5)
    return {
        "cache_dst": _layer_view(host, 1),
        "indices_dst": torch.arange(PAGE, 2 * PAGE),
        "cache_src": _device_rows(2 * PAGE, MLA_DIM, torch.bfloat16, seed=6),
        "indices_src": torch.arange(0, PAGE),
    }


def _misaligned_dst(call: dict, offset: int) -> None:
    """The same rows seen from a base ``offset`` bytes off (a uint8 reinterpretation of the
    host buffer), row size and stride unchanged; the source as uint8 rows too."""
    host = call["cache_dst"]
    raw = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())
    stride = host.stride(0) * host.element_size()
    call["cache_dst"] = raw.as_strided((host.shape[0] - 1, ELEMENT), (stride, 1), offset)
    call["cache_src"] = call["cache_src"].view(torch.uint8)


def _strided_inner(call: dict) -> None:
    """Destination rows of the right width whose elements sit 2 apart (every other element
    of a twice-as-wide page_first layer)."""
    wide = _page_first(4 * PAGE, 2 * MLA_DIM, torch.bfloat16, seed=7)
    call["cache_dst"] = _layer_view(wide, 1)[:, ::2]


#: rule -> (how a valid call breaks it, and only it; what the refusal says)
RULES: Dict[str, tuple] = {
    "dst_not_2d": (lambda c: c.update(cache_dst=c["cache_dst"].unsqueeze(1)), "must be 2-D"),
    "dst_inner_stride": (_strided_inner, r"stride\(1\) must be 1"),
    "row_dims_differ": (lambda c: c.update(cache_src=c["cache_src"][:, : MLA_DIM - 8]), "row dims differ"),
    "dtypes_differ": (lambda c: c.update(cache_src=c["cache_src"].view(torch.float16)), "cache dtypes differ"),
    "cache_not_on_kernel_device": (lambda c: c.update(cache_src=c["cache_src"].to("meta")), "kernel's device"),
    "indices_not_1d": (
        lambda c: c.update(indices_src=c["indices_src"].view(1, -1), indices_dst=c["indices_dst"].view(1, -1)),
        "must be 1-D",
    ),
    "indices_not_contiguous": (
        lambda c: c.update(indices_src=torch.arange(0, 2 * PAGE)[::2]), "not contiguous"
    ),
    "indices_dtype": (
        lambda c: c.update(indices_src=c["indices_src"].short(), indices_dst=c["indices_dst"].short()),
        "int32 or int64",
    ),
    "index_dtypes_differ": (lambda c: c.update(indices_src=c["indices_src"].int()), "index dtypes differ"),
    "indices_not_on_kernel_device": (
        lambda c: c.update(indices_src=c["indices_src"].to("meta"), indices_dst=c["indices_dst"].to("meta")),
        "kernel's device",
    ),
    "lengths_differ": (lambda c: c.update(indices_src=c["indices_src"][:-1]), "destination indices"),
    "negative_index": (lambda c: c.update(indices_src=c["indices_src"] - 1), "outside the cache"),
    "index_past_the_rows": (lambda c: c.update(indices_dst=c["indices_dst"] + 3 * PAGE), "outside the cache"),
}

KERNELS: Dict[str, Callable[[], object]] = {
    "register": lambda: _register(ELEMENT, _default_unroll(ELEMENT)),
    "tma": lambda: hicache_jit.tma_module(block_quota=4),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_the_valid_call_runs(kernel: str) -> None:
    KERNELS[kernel]().launch_one_mla(**_valid_call())


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_tensor_matcher_and_bounds_rule_refuses_its_violation(kernel: str, rule: str) -> None:
    call = _valid_call()
    breaks, says = RULES[rule]
    breaks(call)
    with pytest.raises((ValueError, TypeError, IndexError), match=says):
        KERNELS[kernel]().launch_one_mla(**call)


def test_register_module_refuses_rows_of_another_size_than_it_was_built_for() -> None:
    call = _valid_call()
    with pytest.raises(ValueError, match="cache dimension mismatch"):
        _register(2 * ELEMENT, _default_unroll(2 * ELEMENT)).launch_one_mla(**call)


def test_register_kernel_refuses_empty_indices_and_tma_skips_them() -> None:
    call = _valid_call()
    call["indices_src"], call["indices_dst"] = call["indices_src"][:0], call["indices_dst"][:0]
    before = call["cache_dst"].clone()
    with pytest.raises(RuntimeError, match="0 blocks"):
        KERNELS["register"]().launch_one_mla(**call)
    KERNELS["tma"]().launch_one_mla(**call)
    assert torch.equal(call["cache_dst"].view(torch.uint8), before.view(torch.uint8))


def test_register_kernel_refuses_rows_off_its_package_alignment() -> None:
    # 1152 B rows: unroll 1, 32 lanes of 4-byte packages
    module = _register(ELEMENT, _default_unroll(ELEMENT))
    assert module.package_bytes == 4
    call = _valid_call()
    _misaligned_dst(call, offset=2)
    with pytest.raises(ValueError, match="4-byte aligned"):
        module.launch_one_mla(**call)


def test_tma_kernel_refuses_rows_off_16_bytes() -> None:
    call = _valid_call()
    _misaligned_dst(call, offset=8)  # fine for the register kernel's 4-byte packages
    KERNELS["register"]().launch_one_mla(**call)
    with pytest.raises(ValueError, match="16-byte aligned"):
        KERNELS["tma"]().launch_one_mla(**call)


def test_tma_kernel_refuses_strides_and_rows_off_16_bytes() -> None:
    host = torch.zeros(PAGE, 3, 1, 40, dtype=torch.uint8)  # 40-byte rows, 120-byte stride
    device = torch.zeros(PAGE, 40, dtype=torch.uint8)
    idx = torch.arange(PAGE)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        KERNELS["tma"]().launch_one_mla(_layer_view(host, 0), idx, device, idx)
    host = torch.zeros(PAGE, 3, 1, 48, dtype=torch.uint8)  # 48-byte rows: a 144-byte stride is fine
    padded = torch.zeros(PAGE, 56, dtype=torch.uint8)[:, :48]  # 56-byte device stride is not
    with pytest.raises(RuntimeError, match="strides must be multiples of 16"):
        KERNELS["tma"]().launch_one_mla(_layer_view(host, 0), idx, padded, idx)
    KERNELS["tma"]().launch_one_mla(_layer_view(host, 0), idx, torch.zeros(PAGE, 64, dtype=torch.uint8)[:, :48], idx)


def test_tma_kernel_refuses_a_row_larger_than_its_stage() -> None:
    big = hicache_jit.TMA_STAGE_BYTES + 16
    host = torch.zeros(2, 2, 1, big, dtype=torch.uint8)
    idx = torch.arange(2)
    with pytest.raises(RuntimeError, match="exceed the smem stage"):
        KERNELS["tma"]().launch_one_mla(_layer_view(host, 0), idx, torch.zeros(2, big, dtype=torch.uint8), idx)


def test_entry_points_without_a_stand_in_are_named() -> None:
    for module in KERNELS.values():
        with pytest.raises(NotImplementedError, match="launch_all"):
            module().launch_all


def test_tma_kernel_encodes_a_strided_sources_map_before_skipping_empty_indices() -> None:
    # A load from a page_first view (a strided source) gets a tensor map, whose base must be
    # 16-byte aligned, even when there is nothing to copy.
    host = _page_first(PAGE, FP8_MLA_BYTES, torch.uint8, seed=8)
    raw = torch.empty(0, dtype=torch.uint8).set_(host.untyped_storage())
    stride = LAYERS * FP8_MLA_BYTES
    off_by_8 = raw.as_strided((PAGE - 1, FP8_MLA_BYTES), (stride, 1), 8)
    device = torch.zeros(PAGE, FP8_MLA_BYTES, dtype=torch.uint8)
    none = torch.arange(0)
    KERNELS["tma"]().launch_one_mla(device, none, _layer_view(host, 1), none)
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
        KERNELS["tma"]().launch_one_mla(device, none, off_by_8, none)


# ---- all layers through pointer tables (launch_all_mla) ---------------------------------


def _table(tensors) -> torch.Tensor:
    """``make_kernel_ptr_table`` on the kernel's device (pageable host memory)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _all_layer_call(kernel: str) -> tuple:
    """Every layer of a device stack into page_first per-layer views (upstream's
    ``data_refs`` table, stride ``layout_dim``): the call, the host, the device layers."""
    host = _page_first(4 * PAGE, MLA_DIM, torch.bfloat16, seed=9)
    device = [_device_rows(2 * PAGE, MLA_DIM, torch.bfloat16, seed=10 + layer) for layer in range(LAYERS)]
    args = [
        _table([host.transpose(0, 1)[layer] for layer in range(LAYERS)]),
        torch.arange(PAGE, 2 * PAGE),
        _table(device),
        torch.arange(0, PAGE),
        ELEMENT,  # device row stride
        LAYERS * ELEMENT,  # host layout_dim
    ]
    return (args + [ELEMENT] if kernel == "tma" else args), host, device


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_all_layer_backup_through_pointer_tables_writes_exactly_each_layers_slots(kernel: str) -> None:
    args, host, device = _all_layer_call(kernel)
    expected = host.clone()
    KERNELS[kernel]().launch_all_mla(*args)
    for layer in range(LAYERS):
        expected[args[1], layer, 0] = device[layer][args[3]]
    assert torch.equal(host.view(torch.uint8), expected.view(torch.uint8))


#: rule -> (how a valid all-layer call breaks it, what the refusal says)
TABLE_RULES: Dict[str, tuple] = {
    "table_not_uint64": (lambda a: a.__setitem__(0, a[0].to(torch.int64)), "must be uint64"),
    "table_not_1d": (lambda a: a.__setitem__(2, a[2].view(1, -1)), "must be 1-D"),
    "table_lengths_differ": (lambda a: a.__setitem__(2, a[2][:-1]), "num_layers differ"),
    "null_pointer": (lambda a: a[2].__setitem__(0, 0), "null layer pointer"),
    "negative_index": (lambda a: a.__setitem__(3, a[3] - 1), "negative index"),
    "indices_dtype": (lambda a: a.__setitem__(1, a[1].short()) or a.__setitem__(3, a[3].short()), "int32 or int64"),
    "indices_not_contiguous": (lambda a: a.__setitem__(3, torch.arange(0, 2 * PAGE)[::2]), "not contiguous"),
    "lengths_differ": (lambda a: a.__setitem__(3, a[3][:-1]), "destination indices"),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rule", sorted(TABLE_RULES))
def test_each_all_layer_rule_refuses_its_violation(kernel: str, rule: str) -> None:
    args, host, _ = _all_layer_call(kernel)
    before = host.clone()
    breaks, says = TABLE_RULES[rule]
    breaks(args)
    with pytest.raises((ValueError, TypeError, IndexError), match=says):
        KERNELS[kernel]().launch_all_mla(*args)
    assert torch.equal(host.view(torch.uint8), before.view(torch.uint8))


def test_all_layer_register_kernel_refuses_empty_indices_and_tma_skips_them() -> None:
    for kernel in KERNELS:
        args, host, _ = _all_layer_call(kernel)
        args[1], args[3] = args[1][:0], args[3][:0]
        if kernel == "register":
            with pytest.raises(RuntimeError, match="0 blocks"):
                KERNELS[kernel]().launch_all_mla(*args)
        else:
            KERNELS[kernel]().launch_all_mla(*args)


def test_all_layer_alignment_and_stride_rules() -> None:
    # A host stride 8 bytes off 16 (but on 4-byte packages): the register kernel copies it,
    # the TMA kernel refuses the stride; a base 2 bytes off refuses the register kernel.
    for kernel, module in KERNELS.items():
        args, host, _ = _all_layer_call(kernel)
        args[5] = LAYERS * ELEMENT + 8
        args[1] = torch.arange(0, PAGE)
        if kernel == "tma":
            with pytest.raises(RuntimeError, match="strides must be multiples of 16"):
                module().launch_all_mla(*args)
        else:
            module().launch_all_mla(*args)
    args, _, _ = _all_layer_call("register")
    args[0] = torch.tensor([a + 2 for a in args[0].tolist()], dtype=torch.uint64)
    with pytest.raises(ValueError, match="4-byte aligned"):
        KERNELS["register"]().launch_all_mla(*args)
