"""Registration, the flag and every fail-fast refusal need no kernel, cache or model module;
the hooks on those modules apply when SGLang imports them.

Each test runs a fresh interpreter. The first runs without the CPU runtime (``conftest``'s
``install()``) and with ``sgl_kernel`` unimportable, as on a machine where it is missing.
"""

import json
import subprocess
import sys

# Imported by neither ``sglang.srt.server_args`` nor plugin registration; SGLang's host
# pools import sgl_kernel, the model and attention modules pull kernels and model code.
HEAVY_PREFIXES = (
    "sgl_kernel",
    "sglang.jit_kernel",
    "sglang.srt.mem_cache",  # hiradix_cache, memory_pool(_host), hybrid_cache, common, ...
    "sglang.srt.managers",  # cache_controller, scheduler
    "sglang.srt.model_executor",
    "sglang.srt.models",
    "sglang.srt.layers.attention.nsa_backend",
    "sglang.srt.layers.attention.nsa",  # nsa_indexer
    "sglang.srt.disaggregation",
)
# The only modules of ours that registration, parsing and validation may import.
OURS_ALLOWED = {
    "sglang_cp_hicache",
    "sglang_cp_hicache.plugin",
    "sglang_cp_hicache.hook_table",
    "sglang_cp_hicache.core",
    "sglang_cp_hicache.core.releases",
    "sglang_cp_hicache.core.import_watcher",
    "sglang_cp_hicache.v0_5_12",
    "sglang_cp_hicache.v0_5_12.hooks",
    "sglang_cp_hicache.v0_5_12.server_args",
    "sglang_cp_hicache.v0_5_12.launch_check",
    "sglang_cp_hicache.v0_5_12.layers",
    "sglang_cp_hicache.v0_5_12.layers.attention",
    "sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_support",
    # The per-layer backup table that server_args refuses kernel + page_first from.
    "sglang_cp_hicache.v0_5_12.mem_cache",
    "sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup",
}

SCRIPT = r"""
import json, sys

blocked = []

class BlockSglKernel:
    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            blocked.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, BlockSglKernel())

import sglang.srt.server_args  # its sglang.srt.utils.common tries (and guards) sgl_kernel
del blocked[:]

import sglang.srt.plugins
from sglang.srt.plugins.hook_registry import HookRegistry

sglang.srt.plugins.load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang_cp_hicache.v0_5_12.server_args import CpSharedKVConfigError

refusals = []
for argv in (
    ["--model-path", "dummy", "--enable-nsa-prefill-cp-shared-kv"],
    ["--model-path", "dummy", "--enable-nsa-prefill-cp-shared-kv",
     "--enable-nsa-prefill-context-parallel", "--hicache-storage-backend", "file"],
):
    try:
        prepare_server_args(argv)
    except CpSharedKVConfigError as exc:
        refusals.append(str(exc))
args = prepare_server_args(["--model-path", "dummy", "--served-model-name", "dummy",
                            "--chunked-prefill-size", "8192", "--page-size", "64",
                            "--enable-nsa-prefill-cp-shared-kv",
                            "--enable-nsa-prefill-context-parallel"])
args.enable_grpc = False  # set by __post_init__, which returns early for a dummy model
try:
    args.check_server_args()
except CpSharedKVConfigError as exc:
    refusals.append(str(exc))

from sglang_cp_hicache.v0_5_12 import hooks
print(json.dumps({
    "flag": args.enable_nsa_prefill_cp_shared_kv,
    "refusals": refusals,
    "blocked": blocked,
    "modules": sorted(sys.modules),
    "missing_now": hooks.missing_hooks(import_targets=False),
    "applied": sorted(HookRegistry._patched),
}))
"""


def test_flag_and_refusals_without_kernel_cache_or_model_modules():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to" not in out.stderr, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    assert result["flag"] is True
    assert len(result["refusals"]) == 3
    assert "requires --enable-nsa-prefill-context-parallel" in result["refusals"][0]
    assert "--hicache-storage-backend" in result["refusals"][1]
    assert "--disaggregation-mode prefill" in result["refusals"][2]  # check_server_args
    heavy = [m for m in result["modules"] if m.startswith(HEAVY_PREFIXES)]
    assert heavy == []
    assert result["blocked"] == []  # no attempt at all after sglang.srt.server_args
    ours = {m for m in result["modules"] if m.split(".")[0] == "sglang_cp_hicache"}
    assert ours <= OURS_ALLOWED, ours - OURS_ALLOWED
    # The ServerArgs hooks are applied; the rest wait for their modules' import.
    assert result["missing_now"] == []
    assert {t.rsplit(".", 1)[-1] for t in result["applied"]} >= {
        "add_cli_args", "from_cli_args", "__init__", "__post_init__", "check_server_args"
    }


DEFERRED_SCRIPT = r"""
import json, sys
from sglang_cp_hicache.testing import install

install()  # the CPU runtime: SGLang's cache modules import on this machine
import sglang.srt.plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_cp_hicache.v0_5_12 import hooks
from sglang_cp_hicache.core.import_watcher import installed_watcher

sglang.srt.plugins.load_plugins()
deferred = list(installed_watcher().pending())
import sglang.srt.managers.scheduler  # a scheduler process: imports much of the cache stack
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # the scheduler's lazy import

print(json.dumps({
    "deferred": deferred,
    "hiradix": HiRadixCache.__name__,
    "missing": hooks.missing_hooks(),  # imports every remaining target
    "pending_after": list(installed_watcher().pending()),
    "sources": sorted({str(src and src.plugin_name) for entries in HookRegistry._hooks.values()
                       for _, _, src in entries}),
}))
"""


def test_deferred_hooks_apply_when_sglang_imports_their_modules():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", DEFERRED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to" not in out.stderr, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "sglang.srt.mem_cache.hiradix_cache" in result["deferred"]
    assert "sglang.srt.models.deepseek_v2" in result["deferred"]
    assert result["hiradix"] == "CpHiRadixCache"
    assert result["missing"] == [] and result["pending_after"] == []
    assert result["sources"] == ["cp_hicache"]  # deferred hooks keep load_plugins' source
