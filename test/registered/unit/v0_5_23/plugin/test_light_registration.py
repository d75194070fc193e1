"""Registration on SGLang 0.5.23 is light: in a process that has imported
``sglang.srt.server_args``, ``load_plugins()`` imports only this plugin's registration
modules and SGLang's ``resolution_hooks`` (which imports only ``typing``); parsing
the flag imports nothing that upstream's own parsing does not, and no cache, model or
kernel module is imported at all. The Engine hook waits for
``sglang.srt.entrypoints.engine``. The cost of ``load_plugins()`` is measured and printed.

Runs a fresh interpreter without the CPU runtime (``conftest``'s ``install()``).
"""

import json
import subprocess
import sys

# Registration may add exactly these modules to what sglang.srt.server_args imported.
REGISTRATION_MODULES = {
    "sglang_cp_hicache",
    "sglang_cp_hicache.plugin",
    "sglang_cp_hicache.hook_table",
    "sglang_cp_hicache.core",
    "sglang_cp_hicache.core.releases",
    "sglang_cp_hicache.core.import_watcher",
    "sglang_cp_hicache.v0_5_23",
    "sglang_cp_hicache.v0_5_23.hooks",
    "sglang_cp_hicache.v0_5_23.resolution_steps",
    # the rooms' packages: hook specs by path, none of their modules
    "sglang_cp_hicache.v0_5_23.launch",
    "sglang_cp_hicache.v0_5_23.cache",
    "sglang_cp_hicache.v0_5_23.eviction",
    "sglang_cp_hicache.v0_5_23.selftest",
    "sglang_cp_hicache.v0_5_23.storage",
    "sglang_cp_hicache.v0_5_23.backup",
    "sglang_cp_hicache.v0_5_23.admission",
    "sglang.srt.arg_groups.resolution_hooks",
}
# The first call of a ServerArgs hook (and resolution step) imports the flag's modules.
OURS_AFTER_PARSE = {m for m in REGISTRATION_MODULES if m.startswith("sglang_cp_hicache")} | {
    "sglang_cp_hicache.v0_5_23.launch.flag",
    "sglang_cp_hicache.v0_5_23.launch.cli",
    "sglang_cp_hicache.v0_5_23.launch.legacy_spellings",
    "sglang_cp_hicache.v0_5_23.launch.resolution",
    "sglang_cp_hicache.v0_5_23.launch.refusals",
    "sglang_cp_hicache.v0_5_23.launch.gate_view",
    "sglang_cp_hicache.v0_5_23.launch.cp_mode",  # pure: the mode's enum and its reader
    "sglang_cp_hicache.core.module_binding",  # pure, no import: the gate's binding swap
    "sglang_cp_hicache.core.field_overlay",  # pure, no import: the gate's record views
}
# Cache, scheduler, model, attention, transfer and kernel code: none of it before a launch.
HEAVY_PREFIXES = (
    "sgl_kernel",
    "sglang.jit_kernel",
    "sglang.srt.mem_cache",
    "sglang.srt.managers",
    "sglang.srt.models",
    "sglang.srt.layers",
    "sglang.srt.disaggregation",
    "sglang.srt.entrypoints",
)

SCRIPT = r"""
import json, sys, time

import sglang.srt.server_args
imported = set(sys.modules)

import sglang.srt.plugins
from sglang.srt.plugins.hook_registry import HookRegistry

start = time.perf_counter()
sglang.srt.plugins.load_plugins()
cost_s = time.perf_counter() - start
after_registration = sorted(set(sys.modules) - imported)

from sglang.srt.server_args import prepare_server_args

prepare_server_args(["--model-path", "dummy"])  # upstream's parsing imports its parsers
parsed = set(sys.modules)
args = prepare_server_args(["--model-path", "dummy", "--enable-nsa-prefill-cp-shared-kv",
                            "--enable-nsa-prefill-context-parallel", "--disaggregation-mode", "prefill"])
flag_parse = sorted(set(sys.modules) - parsed)

from sglang_cp_hicache.core.import_watcher import installed_watcher
from sglang_cp_hicache.v0_5_23 import hooks
from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode

print(json.dumps({
    "cost_s": cost_s,
    "after_registration": after_registration,
    "flag_parse": flag_parse,
    "modules": sorted(sys.modules),
    "flag": cp_mode(args).value,
    "cp": [args.enable_prefill_cp, args.cp_strategy],
    "missing_now": hooks.missing_hooks(import_targets=False),
    "applied": sorted(HookRegistry._patched),
    "waiting": sorted(installed_watcher().pending()),
}))
"""


def test_registration_and_parsing_import_no_cache_model_or_kernel_module():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Failed to" not in out.stderr and "cannot register" not in out.stderr, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"load_plugins() after sglang.srt.server_args: {result['cost_s'] * 1000:.1f} ms")

    assert set(result["after_registration"]) <= REGISTRATION_MODULES, (
        set(result["after_registration"]) - REGISTRATION_MODULES
    )
    assert result["flag_parse"] == []
    assert [m for m in result["modules"] if m.startswith(HEAVY_PREFIXES)] == []
    ours = {m for m in result["modules"] if m.split(".")[0] == "sglang_cp_hicache"}
    assert ours <= OURS_AFTER_PARSE, ours - OURS_AFTER_PARSE
    assert result["flag"] == "sharded" and result["cp"] == [True, "interleave"]
    # The ServerArgs hooks are applied; the Engine hook waits for the engine's import.
    assert result["missing_now"] == []
    assert {t.rsplit(".", 1)[-1] for t in result["applied"]} >= {"add_cli_args", "from_cli_args"}
    assert "sglang.srt.entrypoints.engine" in result["waiting"]
    assert result["cost_s"] < 1.0  # measured ~50 ms on a 2-core CPU box
