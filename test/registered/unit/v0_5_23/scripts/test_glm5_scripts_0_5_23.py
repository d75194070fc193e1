"""``scripts/glm5`` spelled for SGLang 0.5.23 on H200: ``--dry-run`` prints the 0.5.23
prefill server, and that very command (a tiny local GLM-5 ``config.json`` in place of the
checkpoint, ``--device cuda`` with an SM90 capability faked) resolves through the real
0.5.23 pipeline and sharding gate: bf16 (flashmla_sparse / fa3) and fp8 (flashmla_kv for
both) are admitted, each the format its CPU twin proves.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.server_args import prepare_server_args

from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode

ROOT = Path(__file__).resolve().parents[5]
SCRIPT = ROOT / "scripts" / "glm5" / "glm5_pd.py"


@pytest.fixture(scope="module")
def glm5_pd():
    spec = importlib.util.spec_from_file_location("glm5_pd_0_5_23", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_0_5_23_spelling():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "prefill", "--dry-run", "--sglang", "0.5.23"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "--enable-prefill-cp --cp-strategy interleave --enable-nsa-prefill-cp-shared-kv" in out
    assert "--enable-nsa-prefill-context-parallel" not in out
    assert "--enable-hierarchical-cache" in out and "--disaggregation-transfer-backend mooncake" in out
    assert "--disaggregation-mode prefill" in out


@pytest.mark.parametrize(
    "dtype, backends",
    [(None, ("flashmla_sparse", "fa3", "bfloat16")), ("fp8_e4m3", ("flashmla_kv", "flashmla_kv", "fp8_e4m3"))],
)
def test_the_0_5_23_prefill_command_resolves_on_h200(glm5_pd, plugins_loaded, tmp_path, monkeypatch, dtype, backends):
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    GlmMoeDsaConfig(num_hidden_layers=2, architectures=["GlmMoeDsaForCausalLM"]).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    command = glm5_pd.prefill_command(glm5_pd.Deployment(sglang="0.5.23", kv_cache_dtype=dtype, tp=2))
    argv = command[command.index("sglang.launch_server") + 1:]
    argv[argv.index("--model-path") + 1] = str(tmp_path)
    argv.remove("--trust-remote-code")
    record = prepare_server_args(argv + ["--device", "cuda"])
    record.resolve_once()
    assert cp_mode(record) is CpMode.SHARDED and resolution_result(record, "enable_kv_cache_sharding") is True
    resolved = tuple(resolution_result(record, f) for f in ("dsa_prefill_backend", "dsa_decode_backend", "kv_cache_dtype"))
    assert resolved == backends
    # Per-layer backup on 0.5.23's default host layout: no layout asked for, kernel I/O.
    assert "--hicache-mem-layout" not in command
    assert (resolution_result(record, "hicache_mem_layout"), resolution_result(record, "hicache_io_backend")) == (
        "page_first", "kernel",
    )
