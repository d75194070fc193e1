"""The serving harness's EAGLE servers (``testing/server/eagle_scenario.py``) as SGLang 0.5.23
resolves their command lines, in a fresh interpreter with the CPU runtime and the plugin
loaded as a server has them: the sharded prefill (the plugin's flag, HiCache) and the decode
both resolve to EAGLE with one chain draft token, and the draft worker's DSA top-k backend is
upstream's torch one (its own flag: ``DSATopKBackend.resolve`` reads
``speculative_dsa_topk_backend`` for a draft worker, whose ``sgl-kernel`` default builds a JIT
CUDA plan, the first blocker ``docs/serving_on_cpu.md`` recorded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_cp_hicache.testing.server.runtime import RUNTIME_ENV

PROBE = r"""
import json
from sglang_cp_hicache.testing.server.runtime import install_server_runtime
install_server_runtime()
import sglang.srt.plugins as plugins
plugins._plugins_loaded = False
plugins.load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_cp_hicache.testing.server.launch import Endpoint, PrefillSpec, decode_argv, line_launch, prefill_argv
from sglang_cp_hicache.testing.server.tiny_model import ensure_checkpoint

line, model = line_launch(), ensure_checkpoint()
eagle = tuple(line.eagle_args())
argvs = {
    "sharded": prefill_argv(line, model, Endpoint(30000, 30001), PrefillSpec("p", extra_args=eagle)),
    "decode": decode_argv(line, model, Endpoint(30002), eagle),
}
results = {}
for name, argv in argvs.items():
    record = prepare_server_args(argv[argv.index("sglang.launch_server") + 1:])
    record.resolve_once()
    results[name] = {key: str(getattr(record, key)) for key in (
        "speculative_algorithm", "speculative_eagle_topk", "speculative_num_steps",
        "speculative_num_draft_tokens", "speculative_dsa_topk_backend", "dsa_topk_backend",
        "enable_hierarchical_cache")}
print("RESULT " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    env = {**os.environ, RUNTIME_ENV: "0", "TMPDIR": str(tmp_path_factory.mktemp("eagle-launch"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [text for text in out.stdout.splitlines() if text.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("server", ["sharded", "decode"])
def test_eagle_servers_resolve_to_one_chain_draft_token_with_the_torch_top_k(resolved, server):
    record = resolved[server]
    assert record["speculative_algorithm"] == "EAGLE"
    assert (record["speculative_eagle_topk"], record["speculative_num_steps"], record["speculative_num_draft_tokens"]) == ("1", "1", "2")
    assert record["speculative_dsa_topk_backend"] == record["dsa_topk_backend"] == "torch"


def test_the_sharded_eagle_prefill_keeps_hicache(resolved):
    assert resolved["sharded"]["enable_hierarchical_cache"] == "True"
