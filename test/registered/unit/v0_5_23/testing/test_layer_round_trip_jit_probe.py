"""``layer_round_trip.probe_page_first_jit``, the GPU check's question before its page_first
round trip: the element sizes it asks upstream about are the ones the page_first stack's
real host pools ask (built here on CPU), and an answer "unavailable" carries upstream's
own warning and what the JIT build would miss on this host."""

from __future__ import annotations

import dataclasses
import logging


def test_the_probe_asks_about_the_element_sizes_the_page_first_host_pools_use(gloo_world1) -> None:
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    from sglang_cp_hicache.testing.v0_5_23.layer_round_trip import page_first_jit_operands, stack_config
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    config = stack_config("cpu", "page_first")
    operands = page_first_jit_operands(config)
    built = dataclasses.replace(config, cp_shared_kv=False, device_pages_per_rank=4)  # unsharded: one rank
    with build_unsharded_stack(gloo_world1, built) as stack:
        pools = [getattr(e.host_pool, "host_pool", e.host_pool) for e in stack.controller.mem_pool_host.entry_map.values()]
        latent = stack.kv_host_pool
        (indexer,) = [pool for pool in pools if isinstance(pool, DSAIndexerPoolHost)]
        assert latent.layout == indexer.layout == "page_first"
        assert operands["latent"] == (latent.kv_cache_dim * latent.dtype.itemsize, latent.page_size)
        assert operands["indexer"] == (indexer.indexer_page_stride_size, 1)


def test_unavailable_names_the_refused_operand_upstreams_last_warning_and_what_is_missing() -> None:
    from sglang.kernels.ops.kvcache import hicache

    from sglang_cp_hicache.testing.v0_5_23.layer_round_trip import probe_page_first_jit

    asked = []

    def refuse_the_latent(*, element_size: int, page_size: int) -> bool:
        asked.append((element_size, page_size))
        if element_size == 1152:  # as upstream does: it warns why, then answers False
            log = logging.getLogger(hicache.__name__)
            log.warning("Failed to load the TMA HiCache kernel, using the register kernel: x")
            log.warning("Failed to load JIT HiCache kernel: [Errno 2] No such file or directory: 'ninja'\nmore")
            return False
        return True

    tools = {"ninja": None, "nvcc": "/usr/local/cuda/bin/nvcc", "c++": "/usr/bin/c++", "cuda_runtime.h": None, "libcudart.so": "/x"}
    probe = probe_page_first_jit(refuse_the_latent, lambda: tools)
    assert asked == [(1152, 64), (8448, 1)]
    assert probe["available"] is False
    assert probe["reason"] == (
        "latent 1152-byte items: Failed to load JIT HiCache kernel: [Errno 2] No such file or directory: 'ninja'"
        "; missing here: ninja, cuda_runtime.h"
    )
    assert len(probe["warnings"]) == 2 and probe["toolchain"] == tools
    assert probe["operands"] == {"latent": [1152, 64], "indexer": [8448, 1]}

    available = probe_page_first_jit(lambda **kw: True, lambda: tools)
    assert available["available"] is True and available["reason"] is None and available["warnings"] == []


def test_the_toolchain_names_what_upstreams_jit_build_runs() -> None:
    from sglang_cp_hicache.testing.v0_5_23.layer_round_trip import jit_toolchain

    tools = jit_toolchain()
    assert list(tools) == ["ninja", "nvcc", "c++", "cuda_runtime.h", "libcudart.so"]
    assert all(path is None or path.startswith("/") for path in tools.values())
