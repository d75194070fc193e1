"""The 0.5.23 CPU server runtime (``testing/v0_5_23/server_runtime.py``): every step reaches the
SGLang module a server looks it up in (checked in a fresh interpreter, as a server process
installs it from its ``sitecustomize``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_cp_hicache.testing.server.runtime import RUNTIME_ENV
from sglang_cp_hicache.testing.v0_5_23 import server_runtime

PROBE = r"""
import json, sys
from sglang_cp_hicache.testing.server.runtime import install_server_runtime
install_server_runtime()
import torch
from sglang.srt.layers.attention.dsa import dsa_indexer
from sglang.srt.layers.attention import dsa_backend
from sglang.srt.layers.rotary_embedding import rope_variant
from sglang.srt.distributed import parallel_state
from sglang.srt.arg_groups import kv_shard_hook
from sglang_cp_hicache.testing.v0_5_23 import server_runtime as rt
from sglang_cp_hicache.testing.server import dsa_kernels
import os
print(json.dumps({
    "cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
    "fuse_topk": os.environ.get("SGLANG_DSA_FUSE_TOPK"),
    "indexer": dsa_indexer.Indexer.forward_native is rt.indexer_forward_native,
    "hadamard": dsa_indexer.rotate_activation is dsa_kernels.hadamard_rotate,
    "decode_transform": dsa_backend.transform_index_page_table_decode is dsa_kernels.transform_index_page_table_decode,
    "seqlens_expand": dsa_backend.seqlens_expand_triton is dsa_kernels.seqlens_expand,
    "last_loc": __import__("sglang.srt.mem_cache.allocation", fromlist=["x"]).get_last_loc_triton.__name__,
    "flash_mla": sys.modules["sglang.kernels.ops.attention.flash_mla_interface"].flash_mla_sparse_fwd.__name__,
    "rope": rope_variant.DeepseekScalingRotaryEmbedding.forward_native.__qualname__,
    "sm": list(torch.cuda.get_device_capability()),
    "event_timing": torch.cuda.Event(enable_timing=True)._timing,
    "gate_device": kv_shard_hook.resolving_view.__name__,
    "sgl_kernel_body": sys.modules["sgl_kernel"].assign_req_to_token_pool_cpu.__module__,
    "eagle_bodies": [getattr(sys.modules["sgl_kernel"], name).__module__ for name in (
        "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "fill_bonus_tokens_cpu",
        "fill_accept_out_cache_loc_cpu", "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu")],
    "still_raising": sys.modules["sgl_kernel"].copy_all_layer_kv_cache_cpu.__name__,
}))
"""


@pytest.fixture(scope="module")
def installed():
    """What a fresh interpreter sees after installing the runtime, as a server does."""
    env = {**os.environ, RUNTIME_ENV: "0"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_every_step_reaches_the_module_that_looks_it_up(installed):
    seen, _ = installed
    assert seen["cpu_engine"] == "1" and seen["fuse_topk"] == "0"
    assert seen["indexer"] and seen["hadamard"] and seen["decode_transform"] and seen["seqlens_expand"]
    assert seen["rope"] == "deepseek_rope_forward_native.<locals>.forward_native"
    assert seen["flash_mla"] == "flash_mla_sparse_fwd_reference"
    assert seen["sm"] == [9, 0] and seen["event_timing"] is True
    assert seen["gate_device"] == "<lambda>"
    assert seen["last_loc"] == "get_last_loc_torch"
    assert seen["sgl_kernel_body"] == "sglang_cp_hicache.testing.server.sgl_kernel_stand_in"
    assert seen["eagle_bodies"] == ["sglang_cp_hicache.testing.server.spec_kernels"] * 6
    assert seen["still_raising"] == "copy_all_layer_kv_cache_cpu"


def test_the_runtime_says_it_is_a_cpu_run_once_naming_every_step(installed):
    _, stderr = installed
    lines = [line for line in stderr.splitlines() if "CPU server runtime" in line]
    assert len(lines) == 1 and "a CPU run, not a GPU one" in lines[0]
    for step in server_runtime.steps():
        assert step.name in lines[0]


def test_the_gate_view_answers_only_the_device():
    class Record:
        device = "cpu"
        enable_prefill_cp = True

    view = server_runtime._CudaDeviceView(Record())
    assert view.device == "cuda" and view.enable_prefill_cp is True
