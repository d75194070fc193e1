"""The pure-torch ``kvcacheio`` reference: every op against plain torch indexing, then a
backup/load round trip through SGLang's real MLA/NSA device and host pools on CPU."""

from __future__ import annotations

import inspect
import threading
from typing import Callable, Dict, List, Sequence, Tuple

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import (
    MLATokenToKVPoolHost,
    NSAIndexerPoolHost,
)

from sglang_cp_hicache.testing import kvcacheio as kio
from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE, on_side_stream

Tensor = torch.Tensor

# MHA: layers, heads, head_dim (bf16 -> 32-byte items, 16-byte heads); MLA: kv dim (80 bytes).
L, H, D, MLA_DIM = 3, 2, 8, 40
HOST_TOKENS, DEV_TOKENS = 64, 48
ITEM = H * D * 2
MLA_ITEM = MLA_DIM * 2
KERNEL_WARPS = dict(block_quota=2, num_warps_per_block=32)

SIGNATURES = {
    "transfer_kv_per_layer": "src_k dst_k src_v dst_v src_indices dst_indices item_size "
    "block_quota num_warps_per_block",
    "transfer_kv_per_layer_pf_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id "
    "item_size src_layout_dim block_quota num_warps_per_block",
    "transfer_kv_per_layer_ph_lf": "src_k dst_k src_v dst_v src_indices dst_indices layer_id "
    "item_size src_layout_dim page_size head_num block_quota num_warps_per_block",
    "transfer_kv_all_layer": "src_k_layers dst_k_layers src_v_layers dst_v_layers src_indices "
    "dst_indices item_size num_layers block_quota num_warps_per_block",
    "transfer_kv_all_layer_lf_pf": "src_k_layers dst_k src_v_layers dst_v src_indices "
    "dst_indices item_size dst_layout_dim num_layers block_quota num_warps_per_block",
    "transfer_kv_all_layer_lf_ph": "src_k_layers dst_k src_v_layers dst_v src_indices "
    "dst_indices item_size dst_layout_dim num_layers page_size head_num block_quota "
    "num_warps_per_block",
    "transfer_kv_direct": "src_layers dst_layers src_indices dst_indices page_size",
    "transfer_kv_per_layer_direct_pf_lf": "src_ptrs dst_ptrs src_indices dst_indices layer_id "
    "page_size",
    "transfer_kv_all_layer_direct_lf_pf": "src_ptrs dst_ptrs src_indices dst_indices page_size",
    "transfer_kv_per_layer_mla": "src dst src_indices dst_indices item_size block_quota "
    "num_warps_per_block",
    "transfer_kv_per_layer_mla_pf_lf": "src dst src_indices dst_indices layer_id item_size "
    "src_layout_dim block_quota num_warps_per_block",
    "transfer_kv_all_layer_mla": "src_layers dst_layers src_indices dst_indices item_size "
    "num_layers block_quota num_warps_per_block",
    "transfer_kv_all_layer_mla_lf_pf": "src_layers dst src_indices dst_indices item_size "
    "dst_layout_dim num_layers block_quota num_warps_per_block",
}


# --- helpers


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def side_stream():
    """Each op on a side stream, as the cache controller issues them (its write/load
    streams): the page-first direct ops refuse the default stream, as CUDA does."""
    with on_side_stream():
        yield


def _rand(shape: Sequence[int], gen: torch.Generator, dtype=torch.bfloat16) -> Tensor:
    """Random bytes viewed as ``dtype`` (NaN patterns included; tests compare bytes)."""
    *lead, last = shape
    nbytes = last * torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*lead, nbytes), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def _mla_rand(rows: int, cols: int, gen: torch.Generator) -> Tensor:
    """Random MLA-shaped ``[rows, cols, 1, MLA_DIM]`` buffer."""
    return _rand((rows, cols, 1, MLA_DIM), gen)


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8)


def _pages(total: int, count: int, gen: torch.Generator, low: int = 0) -> List[int]:
    """``count`` distinct pages in ``[low, total)``: a consecutive pair (so run merging is
    exercised) followed by pages in random order."""
    start = low + int(torch.randint(0, total - low - 1, (1,), generator=gen))
    shuffled = (torch.randperm(total - low, generator=gen) + low).tolist()
    rest = [p for p in shuffled if p not in (start, start + 1)]
    return [start, start + 1] + rest[: count - 2]


def _tokens(pages: Sequence[int], page_size: int) -> Tensor:
    """Token indices covering ``pages`` in order."""
    base = torch.tensor(pages, dtype=torch.long)[:, None] * page_size
    return (base + torch.arange(page_size)).reshape(-1)


def _token_pair(gen: torch.Generator, count: int = 10) -> Tuple[Tensor, Tensor]:
    """Random distinct host and device token indices (kernel ops are per token)."""
    host = _tokens(_pages(HOST_TOKENS, count, gen), 1)
    return host, _tokens(_pages(DEV_TOKENS, count, gen), 1)


Assign = Callable[[Tensor, object], None]


def _expect(before: Tensor, assign: Assign, values: Tensor) -> Tuple[Tensor, Tensor]:
    """Expected buffer (``before`` with ``assign`` applied) and the mask of assigned elements."""
    expected = before.clone()
    assign(expected, values)
    mask = torch.zeros(before.shape, dtype=torch.bool)
    assign(mask, True)
    return expected, mask


def _check(actual: Tensor, before: Tensor, assign: Assign, values: Tensor) -> None:
    """Destination bytes equal the torch-indexing expectation; all other bytes are untouched."""
    expected, mask = _expect(before, assign, values)
    assert mask.any()
    assert torch.equal(_bytes(actual[mask]), _bytes(expected[mask])), "destination bytes differ"
    untouched = torch.equal(_bytes(actual[~mask]), _bytes(before[~mask]))
    assert untouched, "bytes outside the destination changed"


def _table(layers: Sequence[Tensor]) -> Tensor:
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


# --- surface


def test_exports_the_kvcacheio_surface_with_real_signatures() -> None:
    for name, params in SIGNATURES.items():
        signature = inspect.signature(getattr(kio, name))
        assert list(signature.parameters) == params.split(), name
        parameters = signature.parameters.values()
        defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        kernel_defaults = {"block_quota": 2, "num_warps_per_block": 32}
        assert defaults == (kernel_defaults if "block_quota" in params else {}), name


# --- kernel ops, one layer


def test_transfer_kv_per_layer(gen: torch.Generator) -> None:
    host, dev = _rand((2, L, HOST_TOKENS, H, D), gen), _rand((2, L, DEV_TOKENS, H, D), gen)
    src, dst = _token_pair(gen)
    before, layer = dev.clone(), 1
    kio.transfer_kv_per_layer(
        host[0, layer], dev[0, layer], host[1, layer], dev[1, layer], src, dst, ITEM, **KERNEL_WARPS
    )

    def assign(t, v):
        t[:, layer, dst] = v

    _check(dev, before, assign, host[:, layer, src])


def test_transfer_kv_per_layer_pf_lf(gen: torch.Generator) -> None:
    host, dev = _rand((2, HOST_TOKENS, L, H, D), gen), _rand((2, L, DEV_TOKENS, H, D), gen)
    src, dst = _token_pair(gen)
    before, layer = dev.clone(), 2
    kio.transfer_kv_per_layer_pf_lf(
        host[0], dev[0, layer], host[1], dev[1, layer], src, dst,
        layer_id=layer, item_size=ITEM, src_layout_dim=L * ITEM,
    )

    def assign(t, v):
        t[:, layer, dst] = v

    _check(dev, before, assign, host[:, src, layer])


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_per_layer_ph_lf(gen: torch.Generator, page_size: int) -> None:
    host = _rand((2, HOST_TOKENS // page_size, H, page_size, L, D), gen)
    dev = _rand((2, L, DEV_TOKENS, H, D), gen)
    src, dst = _token_pair(gen)
    before, layer = dev.clone(), 1
    kio.transfer_kv_per_layer_ph_lf(
        host[0], dev[0, layer], host[1], dev[1, layer], src, dst,
        layer_id=layer, item_size=ITEM, src_layout_dim=L * ITEM, page_size=page_size, head_num=H,
    )

    def assign(t, v):
        t[:, layer, dst] = v

    # page_head: token p, head h at [p // page_size, h, p % page_size, layer].
    page, slot = src // page_size, src % page_size
    expected = torch.stack([host[kv][page, :, slot, layer] for kv in range(2)])  # [kv, n, h, d]
    _check(dev, before, assign, expected)


def test_transfer_kv_per_layer_mla(gen: torch.Generator) -> None:
    host, dev = _mla_rand(L, HOST_TOKENS, gen), _mla_rand(L, DEV_TOKENS, gen)
    src, dst = _token_pair(gen)
    before, layer = dev.clone(), 0
    kio.transfer_kv_per_layer_mla(host[layer], dev[layer], src, dst, MLA_ITEM)

    def assign(t, v):
        t[layer, dst] = v

    _check(dev, before, assign, host[layer, src])


def test_transfer_kv_per_layer_mla_pf_lf(gen: torch.Generator) -> None:
    host, dev = _mla_rand(HOST_TOKENS, L, gen), _mla_rand(L, DEV_TOKENS, gen)
    src, dst = _token_pair(gen)
    before, layer = dev.clone(), 2
    kio.transfer_kv_per_layer_mla_pf_lf(host, dev[layer], src, dst, layer, MLA_ITEM, L * MLA_ITEM)

    def assign(t, v):
        t[layer, dst] = v

    _check(dev, before, assign, host[src, layer])


# --- kernel ops, all layers


def test_transfer_kv_all_layer(gen: torch.Generator) -> None:
    dev, host = _rand((2, L, DEV_TOKENS, H, D), gen), _rand((2, L, HOST_TOKENS, H, D), gen)
    host_idx, dev_idx = _token_pair(gen)
    before = host.clone()
    kio.transfer_kv_all_layer(
        _table(dev[0]), _table(host[0]), _table(dev[1]), _table(host[1]), dev_idx, host_idx, ITEM, L
    )

    def assign(t, v):
        t[:, :, host_idx] = v

    _check(host, before, assign, dev[:, :, dev_idx])


def test_transfer_kv_all_layer_lf_pf(gen: torch.Generator) -> None:
    dev, host = _rand((2, L, DEV_TOKENS, H, D), gen), _rand((2, HOST_TOKENS, L, H, D), gen)
    host_idx, dev_idx = _token_pair(gen)
    before = host.clone()
    kio.transfer_kv_all_layer_lf_pf(
        _table(dev[0]), host[0], _table(dev[1]), host[1], dev_idx, host_idx, ITEM, L * ITEM, L
    )

    def assign(t, v):
        t[:, host_idx] = v

    _check(host, before, assign, dev[:, :, dev_idx].transpose(1, 2))


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_all_layer_lf_ph(gen: torch.Generator, page_size: int) -> None:
    dev = _rand((2, L, DEV_TOKENS, H, D), gen)
    host = _rand((2, HOST_TOKENS // page_size, H, page_size, L, D), gen)
    host_idx, dev_idx = _token_pair(gen)
    before = host.clone()
    kio.transfer_kv_all_layer_lf_ph(
        _table(dev[0]), host[0], _table(dev[1]), host[1], dev_idx, host_idx,
        item_size=ITEM, dst_layout_dim=L * ITEM, num_layers=L, page_size=page_size, head_num=H,
    )
    page, slot = host_idx // page_size, host_idx % page_size

    def assign(t, v):
        t[:, page, :, slot] = v  # [n, kv, head, layer, dim]: split advanced indices lead

    _check(host, before, assign, dev[:, :, dev_idx].permute(2, 0, 3, 1, 4))


def test_transfer_kv_all_layer_mla(gen: torch.Generator) -> None:
    dev, host = _mla_rand(L, DEV_TOKENS, gen), _mla_rand(L, HOST_TOKENS, gen)
    host_idx, dev_idx = _token_pair(gen)
    before = host.clone()
    kio.transfer_kv_all_layer_mla(_table(dev), _table(host), dev_idx, host_idx, MLA_ITEM, L)

    def assign(t, v):
        t[:, host_idx] = v

    _check(host, before, assign, dev[:, dev_idx])


def test_transfer_kv_all_layer_mla_lf_pf(gen: torch.Generator) -> None:
    dev, host = _mla_rand(L, DEV_TOKENS, gen), _mla_rand(HOST_TOKENS, L, gen)
    host_idx, dev_idx = _token_pair(gen)
    before = host.clone()
    kio.transfer_kv_all_layer_mla_lf_pf(
        _table(dev), host, dev_idx, host_idx, MLA_ITEM, L * MLA_ITEM, L
    )

    def assign(t, v):
        t[host_idx] = v

    _check(host, before, assign, dev[:, dev_idx].transpose(0, 1))


def test_tensor_bases_are_bounds_checked(gen: torch.Generator) -> None:
    host, dev = _mla_rand(L, HOST_TOKENS, gen), _mla_rand(L, DEV_TOKENS, gen)
    host_pf = host.transpose(0, 1).contiguous()
    before = dev.clone()
    one, past_dev = torch.tensor([1]), torch.tensor([DEV_TOKENS])
    past_host = torch.tensor([HOST_TOKENS])
    with pytest.raises(IndexError):
        kio.transfer_kv_per_layer_mla(host[0], dev[0], one, past_dev, MLA_ITEM)
    with pytest.raises(IndexError):
        kio.transfer_kv_per_layer_mla_pf_lf(
            host_pf, dev[0], past_host, one, 2, MLA_ITEM, L * MLA_ITEM
        )
    with pytest.raises(IndexError):  # the run [47, 48] overruns the 48-row destination
        run_src, run_dst = torch.tensor([0, 1]), torch.tensor([DEV_TOKENS - 1, DEV_TOKENS])
        kio.transfer_kv_direct([host[0]], [dev[0]], run_src, run_dst, 1)
    assert torch.equal(_bytes(dev), _bytes(before))


# --- direct ops


@pytest.mark.parametrize("page_size", [1, 4])
def test_transfer_kv_direct(gen: torch.Generator, page_size: int) -> None:
    dev, host = _rand((2, L, DEV_TOKENS, H, D), gen), _rand((2, L, HOST_TOKENS, H, D), gen)
    dev_idx = _tokens(_pages(DEV_TOKENS // page_size, 5, gen), page_size)
    host_idx = _tokens(_pages(HOST_TOKENS // page_size, 5, gen), page_size)
    before = host.clone()
    src_layers, dst_layers = list(dev[0]) + list(dev[1]), list(host[0]) + list(host[1])
    kio.transfer_kv_direct(src_layers, dst_layers, dev_idx, host_idx, page_size)

    def assign(t, v):
        t[:, :, host_idx] = v

    _check(host, before, assign, dev[:, :, dev_idx])


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_transfer_kv_per_layer_direct_pf_lf(
    gen: torch.Generator, page_size: int, mla: bool
) -> None:
    parts = 1 if mla else 2
    host = _rand((parts, HOST_TOKENS // page_size, L, page_size, H, D), gen)
    dev = _rand((parts, L, DEV_TOKENS, H, D), gen)
    host_idx = _tokens(_pages(HOST_TOKENS // page_size, 5, gen), page_size)
    dev_idx = _tokens(_pages(DEV_TOKENS // page_size, 5, gen), page_size)
    before, first_layer = dev.clone(), 1
    # Two destination layers per part: dst_ptrs[j] receives host layer layer_id + j.
    dst_ptrs = [dev[p, first_layer + j] for p in range(parts) for j in range(2)]
    kio.transfer_kv_per_layer_direct_pf_lf(
        list(host), dst_ptrs, host_idx, dev_idx, first_layer, page_size
    )
    page, slot = host_idx // page_size, host_idx % page_size
    layers = slice(first_layer, first_layer + 2)

    def assign(t, v):
        t[:, layers, dev_idx] = v

    # host[:, page, layers, slot] is [n, part, layer, head, dim] (split advanced indices).
    _check(dev, before, assign, host[:, page, layers, slot].permute(1, 2, 0, 3, 4))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_transfer_kv_all_layer_direct_lf_pf(
    gen: torch.Generator, page_size: int, mla: bool
) -> None:
    parts = 1 if mla else 2
    dev = _rand((parts, L, DEV_TOKENS, H, D), gen)
    host = _rand((parts, HOST_TOKENS // page_size, L, page_size, H, D), gen)
    dev_idx = _tokens(_pages(DEV_TOKENS // page_size, 5, gen), page_size)
    host_idx = _tokens(_pages(HOST_TOKENS // page_size, 5, gen), page_size)
    before = host.clone()
    src_ptrs = [dev[p, j] for p in range(parts) for j in range(L)]
    kio.transfer_kv_all_layer_direct_lf_pf(src_ptrs, list(host), dev_idx, host_idx, page_size)
    page, slot = host_idx // page_size, host_idx % page_size

    def assign(t, v):
        t[:, page, :, slot] = v  # [n, part, layer, head, dim]: split advanced indices lead

    _check(host, before, assign, dev[:, :, dev_idx].permute(2, 0, 1, 3, 4))


# --- launcher rules: refuse what the real kernel would crash on or misread

OpCall = Callable[[Tensor, Tensor], None]
KERNEL_OPS = [name for name in SIGNATURES if "block_quota" in SIGNATURES[name]]
DIRECT_OPS = [name for name in SIGNATURES if "block_quota" not in SIGNATURES[name]]
# Valid on every source and destination buffer below (all hold >= DEV_TOKENS rows).
SRC, DST = torch.tensor([3, 4, 7]), torch.tensor([5, 6, 9])


def _kernel_calls(gen: torch.Generator) -> Dict[str, Tuple[OpCall, Tensor]]:
    """Every kernel op bound to fresh buffers: ``name -> (call(src, dst), written buffer)``."""
    mha_h, mha_d = _rand((2, L, HOST_TOKENS, H, D), gen), _rand((2, L, DEV_TOKENS, H, D), gen)
    pf, ph = _rand((2, HOST_TOKENS, L, H, D), gen), _rand((2, HOST_TOKENS, H, 1, L, D), gen)
    mla_h, mla_d = _mla_rand(L, HOST_TOKENS, gen), _mla_rand(L, DEV_TOKENS, gen)
    mla_pf = _mla_rand(HOST_TOKENS, L, gen)
    dk, dv, hk, hv = _table(mha_d[0]), _table(mha_d[1]), _table(mha_h[0]), _table(mha_h[1])
    one = (mha_d[0, 0], mha_d[1, 0])
    return {
        "transfer_kv_per_layer": (
            lambda s, d: kio.transfer_kv_per_layer(
                mha_h[0, 0], one[0], mha_h[1, 0], one[1], s, d, ITEM
            ),
            mha_d,
        ),
        "transfer_kv_per_layer_pf_lf": (
            lambda s, d: kio.transfer_kv_per_layer_pf_lf(
                pf[0], one[0], pf[1], one[1], s, d, 0, ITEM, L * ITEM
            ),
            mha_d,
        ),
        "transfer_kv_per_layer_ph_lf": (
            lambda s, d: kio.transfer_kv_per_layer_ph_lf(
                ph[0], one[0], ph[1], one[1], s, d, 0, ITEM, L * ITEM, 1, H
            ),
            mha_d,
        ),
        "transfer_kv_all_layer": (
            lambda s, d: kio.transfer_kv_all_layer(dk, hk, dv, hv, s, d, ITEM, L),
            mha_h,
        ),
        "transfer_kv_all_layer_lf_pf": (
            lambda s, d: kio.transfer_kv_all_layer_lf_pf(
                dk, pf[0], dv, pf[1], s, d, ITEM, L * ITEM, L
            ),
            pf,
        ),
        "transfer_kv_all_layer_lf_ph": (
            lambda s, d: kio.transfer_kv_all_layer_lf_ph(
                dk, ph[0], dv, ph[1], s, d, ITEM, L * ITEM, L, 1, H
            ),
            ph,
        ),
        "transfer_kv_per_layer_mla": (
            lambda s, d: kio.transfer_kv_per_layer_mla(mla_h[0], mla_d[0], s, d, MLA_ITEM),
            mla_d,
        ),
        "transfer_kv_per_layer_mla_pf_lf": (
            lambda s, d: kio.transfer_kv_per_layer_mla_pf_lf(
                mla_pf, mla_d[0], s, d, 0, MLA_ITEM, L * MLA_ITEM
            ),
            mla_d,
        ),
        "transfer_kv_all_layer_mla": (
            lambda s, d: kio.transfer_kv_all_layer_mla(
                _table(mla_d), _table(mla_h), s, d, MLA_ITEM, L
            ),
            mla_h,
        ),
        "transfer_kv_all_layer_mla_lf_pf": (
            lambda s, d: kio.transfer_kv_all_layer_mla_lf_pf(
                _table(mla_d), mla_pf, s, d, MLA_ITEM, L * MLA_ITEM, L
            ),
            mla_pf,
        ),
    }


def _refuses(
    calls: Dict[str, Tuple[OpCall, Tensor]],
    name: str,
    src: Tensor,
    dst: Tensor,
    error: type,
    match: str,
) -> None:
    """Op ``name`` of ``calls`` raises ``error`` naming itself and leaves its destination as is."""
    call, written = calls[name]
    before = written.clone()
    with pytest.raises(error, match=f"{name}: {match}"):
        call(src, dst)
    assert torch.equal(_bytes(written), _bytes(before))


def test_kernel_op_table_covers_every_kernel_op(gen: torch.Generator) -> None:
    assert sorted(_kernel_calls(gen)) == sorted(KERNEL_OPS)


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_ops_copy_valid_indices(gen: torch.Generator, name: str) -> None:
    """The bound calls are valid, so the refusals below are the rules, not bad set-ups."""
    call, written = _kernel_calls(gen)[name]
    before = written.clone()
    call(SRC, DST)
    assert not torch.equal(_bytes(written), _bytes(before))


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_ops_refuse_negative_indices(gen: torch.Generator, name: str) -> None:
    # The sm_90 kernel has no negative-index skip: it would write before the buffer base.
    calls = _kernel_calls(gen)
    _refuses(calls, name, torch.tensor([3, -1, 7]), DST, IndexError, "src_indices holds negative")
    _refuses(calls, name, SRC, torch.tensor([5, 9, -1]), IndexError, "dst_indices holds negative")


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_ops_refuse_empty_indices(gen: torch.Generator, name: str) -> None:
    # The launcher computes div_up(0, 0) for zero items: SIGFPE kills the process.
    none = torch.empty(0, dtype=torch.int64)
    calls = _kernel_calls(gen)
    _refuses(calls, name, none, none, ValueError, "empty index tensors")


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_ops_refuse_non_contiguous_indices(gen: torch.Generator, name: str) -> None:
    # Logically [3, 4, 7]; the kernel reads data_ptr in memory order: 3, 40, 4.
    strided = torch.tensor([3, 40, 4, 41, 7, 42])[::2]
    calls = _kernel_calls(gen)
    _refuses(calls, name, strided, DST, ValueError, "src_indices is not contiguous")
    strided_dst = torch.tensor([5, 40, 6, 41, 9, 42])[::2]
    _refuses(calls, name, SRC, strided_dst, ValueError, "dst_indices is not contiguous")


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_ops_refuse_indices_off_the_kernel_device(gen: torch.Generator, name: str) -> None:
    # The launcher refuses non-CUDA indices; the stand-in's "CUDA" is the CPU.
    elsewhere = SRC.to("meta")
    calls = _kernel_calls(gen)
    _refuses(calls, name, elsewhere, DST, ValueError, "src_indices must be on cpu")
    _refuses(calls, name, SRC, elsewhere, ValueError, "dst_indices must be on cpu")


def test_pointer_tables_must_be_uint64(gen: torch.Generator) -> None:
    dev, host = _mla_rand(L, DEV_TOKENS, gen), _mla_rand(L, HOST_TOKENS, gen)
    signed = _table(dev).view(torch.int64)  # data_ptr<uintptr_t>() refuses it
    with pytest.raises(TypeError, match="pointer table must be uint64"):
        kio.transfer_kv_all_layer_mla(signed, _table(host), SRC, DST, MLA_ITEM, L)


def _direct_calls(gen: torch.Generator) -> Dict[str, Tuple[OpCall, Tensor]]:
    """Every direct op (MLA, page size 1) on fresh buffers: ``name -> (call, written)``."""
    dev, host_lf = _mla_rand(L, DEV_TOKENS, gen), _mla_rand(L, HOST_TOKENS, gen)
    host_pf = _mla_rand(HOST_TOKENS, L, gen).unsqueeze(2)  # [page, layer, page_size=1, 1, dim]
    return {
        "transfer_kv_direct": (
            lambda s, d: kio.transfer_kv_direct(list(dev), list(host_lf), s, d, 1),
            host_lf,
        ),
        "transfer_kv_per_layer_direct_pf_lf": (
            lambda s, d: kio.transfer_kv_per_layer_direct_pf_lf([host_pf], [dev[0]], s, d, 0, 1),
            dev,
        ),
        "transfer_kv_all_layer_direct_lf_pf": (
            lambda s, d: kio.transfer_kv_all_layer_direct_lf_pf(list(dev), [host_pf], s, d, 1),
            host_pf,
        ),
    }


@pytest.mark.parametrize("name", DIRECT_OPS)
def test_direct_ops_copy_valid_indices_and_skip_empty_ones(
    gen: torch.Generator, name: str
) -> None:
    # The C++ loops over zero pages for empty indices: a no-op, not a crash.
    call, written = _direct_calls(gen)[name]
    before = written.clone()
    call(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert torch.equal(_bytes(written), _bytes(before))
    call(SRC, DST)
    assert not torch.equal(_bytes(written), _bytes(before))


@pytest.mark.parametrize("name", DIRECT_OPS)
def test_page_first_direct_ops_refuse_the_default_stream(gen: torch.Generator, name: str) -> None:
    """cudaMemcpyBatchAsync rejects the legacy default stream ("invalid argument" on an H200,
    CUDA 13); empty indices never reach it, and ``transfer_kv_direct`` (plain copies) runs
    on any stream. A stream block on another thread does not count for this one."""
    call, written = _direct_calls(gen)[name]
    empty = torch.empty(0, dtype=torch.int64)
    with CPU_DEVICE_MODULE.stream(CPU_DEVICE_MODULE.default_stream):
        call(empty, empty)
        if name == "transfer_kv_direct":
            call(SRC, DST)
            return
        before = written.clone()
        with pytest.raises(RuntimeError, match=f"{name}: cudaMemcpyBatchAsync rejects the legacy default stream"):
            call(SRC, DST)
        assert torch.equal(_bytes(written), _bytes(before))
        with on_side_stream():
            errors = []
            worker = threading.Thread(target=lambda: _record_error(errors, call))
            worker.start()
            worker.join()
            assert [type(e) for e in errors] == [RuntimeError]
            call(SRC, DST)  # this thread is on a side stream


def _record_error(errors: list, call: OpCall) -> None:
    try:
        call(SRC, DST)
    except RuntimeError as exc:
        errors.append(exc)


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_ops_refuse_int32_indices(gen: torch.Generator, name: str) -> None:
    # Kernel ops: TORCH_CHECK(kLong); direct ops: data_ptr<int64_t>() raises for int32.
    calls = {**_kernel_calls(gen), **_direct_calls(gen)}
    _refuses(calls, name, SRC.int(), DST, TypeError, "src_indices must be int64")
    _refuses(calls, name, SRC, DST.int(), TypeError, "dst_indices must be int64")


@pytest.mark.parametrize("name", DIRECT_OPS)
def test_direct_ops_refuse_negative_indices(gen: torch.Generator, name: str) -> None:
    # A negative slice start wraps around to the end of the buffer.
    calls = _direct_calls(gen)
    _refuses(calls, name, torch.tensor([-1]), DST[:1], IndexError, "src_indices")
    _refuses(calls, name, SRC[:1], torch.tensor([-1]), IndexError, "dst_indices")


@pytest.mark.parametrize("name", DIRECT_OPS)
def test_direct_ops_refuse_non_contiguous_cpu_indices(gen: torch.Generator, name: str) -> None:
    # .cpu() of a CPU tensor is the tensor itself; data_ptr reads it in memory order.
    strided = torch.tensor([3, 40, 4, 41, 7, 42])[::2]
    calls = _direct_calls(gen)
    _refuses(calls, name, strided, DST, ValueError, "src_indices is not contiguous")


PS = 4


def _pf_direct_buffers(gen: torch.Generator) -> Tuple[Tensor, Tensor]:
    """Device ``[layer, token, head, dim]`` and page_first_direct host
    ``[page, layer, page_size, head, dim]`` buffers, both contiguous."""
    dev = _rand((L, DEV_TOKENS, H, D), gen)
    return dev, _rand((HOST_TOKENS // PS, L, PS, H, D), gen)


def _pf_direct_both(lf: List[Tensor], pf: List[Tensor], match: str) -> None:
    """Both page-first direct ops refuse these buffers with ``match``."""
    idx = _tokens([1, 2], PS)
    with pytest.raises(ValueError, match=f"transfer_kv_all_layer_direct_lf_pf: {match}"):
        kio.transfer_kv_all_layer_direct_lf_pf(lf, pf, idx, idx, PS)
    with pytest.raises(ValueError, match=f"transfer_kv_per_layer_direct_pf_lf: {match}"):
        kio.transfer_kv_per_layer_direct_pf_lf(pf, lf, idx, idx, 0, PS)


def test_page_first_direct_refuses_strided_layer_views(gen: torch.Generator) -> None:
    # Token-major device buffer: layer j is a strided view; the batch copy of page_size *
    # stride(0) bytes would move every layer's rows, spilling into the neighbours.
    _, host = _pf_direct_buffers(gen)
    token_major = _rand((DEV_TOKENS, L, H, D), gen)
    _pf_direct_both([token_major[:, j] for j in range(L)], [host], "layer buffer 0")


def test_page_first_direct_refuses_mismatched_pf_strides(gen: torch.Generator) -> None:
    # The batch copy addresses v's pages with k's strides.
    dev, k = _pf_direct_buffers(gen)
    v = _rand((HOST_TOKENS // PS, L + 1, PS, H, D), gen)[:, :L]
    _pf_direct_both(list(dev) + list(dev), [k, v], "page-first buffer 1 strides")


def test_page_first_direct_refuses_padded_pages(gen: torch.Generator) -> None:
    # Rows padded to 2*D: copy_ would copy the D columns, the batch copy raw padded bytes.
    dev, _ = _pf_direct_buffers(gen)
    padded = _rand((HOST_TOKENS // PS, L, PS, H, 2 * D), gen)[..., :D]
    _pf_direct_both(list(dev), [padded], "page-first buffer 0 does not hold contiguous pages")


def test_page_first_direct_refuses_mixed_element_sizes(gen: torch.Generator) -> None:
    # copy_ would convert bf16 to fp32; the batch copy moves raw bytes of one element size.
    dev, host = _pf_direct_buffers(gen)
    _pf_direct_both([t.float() for t in dev], [host], "buffers differ in element size")


# --- real SGLang pools

POOL_LAYERS = 2


def _device_pool(kind: str) -> MLATokenToKVPool:
    common = dict(
        size=1024, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=POOL_LAYERS,
        dtype=torch.bfloat16, device="cpu", enable_memory_saver=False,
    )
    if kind == "nsa":
        return NSATokenToKVPool(page_size=64, index_head_dim=128, kv_cache_dim=576, **common)
    return MLATokenToKVPool(page_size=16, **common)


def _host_pools(device_pool: MLATokenToKVPool, layout: str) -> list:
    # Default pin_memory=True: install() must turn pinning off for this to work without CUDA.
    anchor = MLATokenToKVPoolHost(device_pool, 2.0, 0, device_pool.page_size, layout)
    if isinstance(device_pool, NSATokenToKVPool):
        return [anchor, NSAIndexerPoolHost(device_pool, anchor, layout)]
    return [anchor]


def _device_buffers(device_pool: MLATokenToKVPool) -> List[Tuple[List[Tensor], int]]:
    """(per-layer buffers, tokens per row): KV rows are tokens, indexer rows are pages."""
    buffers = [(device_pool.kv_buffer, 1)]
    if isinstance(device_pool, NSATokenToKVPool):
        buffers.append((device_pool.index_k_with_scale_buffer, device_pool.page_size))
    return buffers


IO_LAYOUTS = [
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
]


@pytest.mark.parametrize("io_backend, layout", IO_LAYOUTS)
@pytest.mark.parametrize("kind", ["mla", "nsa"])
def test_host_pool_round_trip(
    gen: torch.Generator, kind: str, io_backend: str, layout: str
) -> None:
    device_pool = _device_pool(kind)
    hosts = _host_pools(device_pool, layout)
    page_size = device_pool.page_size
    buffers = _device_buffers(device_pool)
    for layers, _ in buffers:
        for buf in layers:
            raw = buf.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    originals = [[buf.clone() for buf in layers] for layers, _ in buffers]

    # Device pages 1..15 exist in both pools (NSA's indexer has 17 page rows); old/new disjoint.
    dev_pages = _pages(16, 6, gen, low=1)
    old_idx, new_idx = _tokens(dev_pages[:3], page_size), _tokens(dev_pages[3:], page_size)
    host_idx = _tokens(_pages(hosts[0].page_num - 1, 3, gen), page_size)

    for host in hosts:
        host.backup_from_device_all_layer(device_pool, host_idx, old_idx, io_backend)
    for layers, _ in buffers:
        for buf in layers:
            buf.zero_()
    for layer_id in range(POOL_LAYERS):
        for host in hosts:
            host.load_to_device_per_layer(device_pool, host_idx, new_idx, layer_id, io_backend)

    for (layers, per_row), original in zip(buffers, originals):
        old_rows, new_rows = old_idx[::per_row] // per_row, new_idx[::per_row] // per_row
        for buf, orig in zip(layers, original):
            expected = torch.zeros_like(orig)
            expected[new_rows] = orig[old_rows]
            assert torch.equal(_bytes(buf), _bytes(expected))
