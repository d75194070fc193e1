"""HiCache L3 storage admitted at startup under the plugin's flag (issue 24).

Through the real 0.5.23 resolution pipeline and sharding gate, on a tiny local GLM-5
``config.json`` resolved as ``--device cuda`` on the CPU (only the GPU's compute capability
is faked, as an H200). Upstream's gate refuses any ``--hicache-storage-backend`` under
sharding (``arg_groups/kv_shard_hook.py:176-181``); under the flag it is shown a view
without the storage backend, so file and mooncake resolve and keep their backend, every
other backend is refused by the plugin naming the flag, every other rule of the gate still
refuses, and with the flag off upstream's verdict is unchanged.
"""

import pytest
from sglang.srt.arg_groups import kv_shard_hook as upstream_gate
from sglang.srt.arg_groups.overrides import resolution_result

from sglang_cp_hicache.testing.v0_5_23.resolution import HICACHE, PD_PREFILL_CP, resolve
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError

UPSTREAM_STORAGE_REFUSAL = "supports HiCache host offload but not --hicache-storage-backend yet"


pytestmark = pytest.mark.usefixtures("h200")


@pytest.fixture(scope="module")
def glm5(glm5_path):
    return ["--model-path", glm5_path, "--device", "cuda", "--tp", "2"] + PD_PREFILL_CP + HICACHE


def storage(backend):
    return ["--hicache-storage-backend", backend]


# The host layouts upstream's gate lets DSA HiCache run with (kernel I/O); Mooncake's is
# page-first (upstream's layer_first -> page_first rewrite for kernel I/O).
LAYOUTS = {"file": ("layer_first", "page_first"), "mooncake": ("page_first",)}


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_file_and_mooncake_resolve_under_the_flag(glm5, backend):
    with pytest.raises(ValueError, match=UPSTREAM_STORAGE_REFUSAL):  # what a new user met
        resolve(glm5 + storage(backend) + ["--enable-kv-cache-sharding"])
    record = resolve(glm5 + storage(backend) + [CLI_FLAG])
    assert resolution_result(record, "hicache_storage_backend") == backend
    assert resolution_result(record, "enable_kv_cache_sharding") is True
    assert resolution_result(record, "hicache_mem_layout") in LAYOUTS[backend]
    assert resolution_result(record, "hicache_io_backend") == "kernel"
    # The gate's module reads the record through upstream's own view again afterwards.
    assert upstream_gate.resolving_view(record).hicache_storage_backend == backend


def test_other_backends_are_refused_by_the_plugin(glm5):
    with pytest.raises(CpSharedKVConfigError) as refused:
        resolve(glm5 + storage("hf3fs") + [CLI_FLAG])
    message = str(refused.value)
    assert message.startswith(f"{CLI_FLAG}: ")
    assert "--hicache-storage-backend file or mooncake only (got hf3fs)" in message


UPSTREAM_RULES = [
    # the DSA HiCache rule of the same gate, right after its storage rule
    (["--hicache-io-backend", "direct"], "CP-sharded DSA HiCache requires kernel I/O"),
    (["--enable-dsa-cache-layer-split"], "DSA KV sharding requires Mooncake"),
    (["--chunked-prefill-size", "-1"], "requires chunked prefill"),
]


@pytest.mark.parametrize("extra, needle", UPSTREAM_RULES, ids=[r[0][0] for r in UPSTREAM_RULES])
def test_every_other_rule_of_the_gate_still_refuses_with_storage(glm5, extra, needle):
    with pytest.raises(ValueError, match=needle) as refused:
        resolve(glm5 + storage("file") + extra + [CLI_FLAG])
    assert not isinstance(refused.value, CpSharedKVConfigError)


def test_flag_off_sharding_with_storage_is_still_refused_by_upstream(glm5):
    with pytest.raises(ValueError, match=UPSTREAM_STORAGE_REFUSAL):
        resolve(glm5 + storage("mooncake") + ["--enable-kv-cache-sharding"])
    # and without sharding upstream admits storage as always
    plain = [a for a in glm5 if a not in ("--enable-prefill-cp",)]
    record = resolve(plain + storage("file"))
    assert resolution_result(record, "hicache_storage_backend") == "file"
