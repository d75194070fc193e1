"""The plugin's flag on one prefill rank (``--tp 1``, CP size 1), through the real 0.5.23
resolution pipeline on a tiny local GLM-5 ``config.json`` (``--device cuda`` on the CPU,
the GPU faked as an H200), issue 24.

Upstream accepts ``--enable-prefill-cp --cp-strategy interleave`` at ``--tp 1`` (CP size 1)
but refuses DSA KV sharding there ("requires CUDA interleave prefill CP > 1"). Under the flag
a one-rank record with L3 file or mooncake storage declares no sharding and its mode is
``CpMode.ONE_RANK_L3_READER``: the sharding deltas are off, the owner-free L3 keys on. Every other refusal is unchanged; at cp 1 the flag also needs
HiCache and PP 1. Without L3 storage (where it would change nothing) the flag declares
sharding as everywhere and upstream refuses CP size 1.
"""

import pickle

import pytest
from sglang.srt.arg_groups.overrides import resolution_result

from sglang_cp_hicache.testing.v0_5_23.resolution import HICACHE, PD_PREFILL_CP, resolve
from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode, store_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError

UPSTREAM_CP1_REFUSAL = "DSA KV sharding requires CUDA interleave prefill CP > 1"


pytestmark = pytest.mark.usefixtures("h200")


@pytest.fixture(scope="module")
def glm5_model(glm5_path):
    return ["--model-path", glm5_path, "--device", "cuda"]


@pytest.fixture(scope="module")
def cp1(glm5_model):
    return glm5_model + ["--tp", "1"] + PD_PREFILL_CP + HICACHE


def storage(backend):
    return ["--hicache-storage-backend", backend]


def test_upstream_takes_prefill_cp_at_tp1_as_cp_size_1(cp1):
    record = resolve(cp1 + storage("file"))  # flag off: upstream's unsharded server
    assert resolution_result(record, "attn_cp_size") == 1
    assert resolution_result(record, "enable_kv_cache_sharding") is False
    with pytest.raises(ValueError, match=UPSTREAM_CP1_REFUSAL):  # upstream's sharding at cp 1
        resolve(cp1 + ["--enable-kv-cache-sharding"])


def test_an_explicit_sharding_request_at_cp1_keeps_upstreams_verdict(cp1):
    with pytest.raises(ValueError, match=UPSTREAM_CP1_REFUSAL) as refused:
        resolve(cp1 + storage("file") + ["--enable-kv-cache-sharding", CLI_FLAG])
    assert not isinstance(refused.value, CpSharedKVConfigError)


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_the_flag_at_cp1_resolves_unsharded_with_owner_free_storage(cp1, backend):
    record = resolve(cp1 + storage(backend) + [CLI_FLAG])
    assert resolution_result(record, "attn_cp_size") == 1
    assert resolution_result(record, "enable_kv_cache_sharding") is False
    assert resolution_result(record, "hicache_storage_backend") == backend
    assert cp_mode(record) is CpMode.ONE_RANK_L3_READER
    assert not cp_mode(record).shards_kv, "the sharding deltas must be off at cp 1"
    assert cp_mode(record).owner_free_storage
    # The mode travels to spawned schedulers with the record.
    assert cp_mode(pickle.loads(pickle.dumps(record))) is CpMode.ONE_RANK_L3_READER


def test_the_flag_at_cp2_still_declares_sharding(glm5_model):
    record = resolve(glm5_model + ["--tp", "2"] + PD_PREFILL_CP + HICACHE + storage("file") + [CLI_FLAG])
    assert resolution_result(record, "enable_kv_cache_sharding") is True
    assert cp_mode(record) is CpMode.SHARDED


def _refused(argv) -> str:
    with pytest.raises(CpSharedKVConfigError) as refused:
        resolve(argv + [CLI_FLAG])
    message = str(refused.value)
    assert message.startswith(f"{CLI_FLAG}: ")
    return message


def test_the_flag_at_cp1_without_storage_keeps_upstreams_cp1_refusal(cp1):
    """Without L3 storage the flag changes nothing at cp 1: it declares sharding as
    everywhere, and upstream refuses DSA sharding at CP size 1."""
    with pytest.raises(ValueError, match=UPSTREAM_CP1_REFUSAL) as refused:
        resolve(cp1 + [CLI_FLAG])
    assert not isinstance(refused.value, CpSharedKVConfigError)


def test_the_flag_at_cp1_with_storage_but_no_hicache_is_refused(glm5_model):
    no_hicache = glm5_model + ["--tp", "1"] + PD_PREFILL_CP + storage("file")
    assert "--hicache-storage-backend file needs --enable-hierarchical-cache" in _refused(no_hicache)


# Every refusal of the flag stays at cp 1 (each with file storage, which cp 1 needs).
CP1_REFUSALS = [
    (storage("hf3fs"), "--hicache-storage-backend file or mooncake only (got hf3fs)"),
    (["--disaggregation-mode", "null"], "serves only as a PD prefill worker"),
    (["--cp-strategy", "zigzag"], "supports --cp-strategy interleave only"),
    (["--enable-hisparse"], "does not support --enable-hisparse"),
    (["--speculative-algorithm", "NEXTN"], "--speculative-algorithm NEXTN: write EAGLE"),
    (["--pp-size", "2"], "on one prefill rank needs --pp-size 1 (got 2)"),
]


@pytest.mark.parametrize("extra, needle", CP1_REFUSALS, ids=[r[0][0] + r[0][-1] for r in CP1_REFUSALS])
def test_every_other_refusal_of_the_flag_stays_at_cp1(cp1, extra, needle):
    argv = cp1 + (extra if extra[0] == "--hicache-storage-backend" else storage("file") + extra)
    assert needle in _refused(argv)


def test_the_flag_at_cp1_without_prefill_cp_is_refused(glm5_model):
    argv = glm5_model + ["--tp", "1"] + PD_PREFILL_CP[3:] + HICACHE + storage("file")
    assert "needs prefill context parallelism" in _refused(argv)


def test_a_non_dsa_model_is_refused_at_cp1(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    argv = ["--model-path", str(tmp_path), "--device", "cuda", "--tp", "1"]
    argv += PD_PREFILL_CP[:-2] + HICACHE + storage("file")
    assert "needs a DSA sparse-attention model" in _refused(argv)


def test_a_marked_record_resolved_to_cp_above_1_is_refused():
    """The one-rank decision precedes the model's CP size; upstream's own assertion
    (``tp_size must be divisible by attn_cp_size``) refuses ``--tp 1 --attn-cp-size 2``
    first today, and the model step refuses any later disagreement."""
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_hicache.v0_5_23.launch import resolution

    record = ServerArgs(model_path="dummy", attn_cp_size=2)
    store_mode(record, CpMode.ONE_RANK_L3_READER)  # as the one-rank decision leaves it
    with pytest.raises(CpSharedKVConfigError, match="resolution gave attn_cp_size 2"):
        resolution._refuse_resharded_single_rank(record)
