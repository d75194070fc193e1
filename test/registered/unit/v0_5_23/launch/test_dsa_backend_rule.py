"""DSA KV sharding on Hopper through the real 0.5.23 resolution pipeline and sharding gate.

A tiny local GLM-5 ``config.json`` resolves as ``--device cuda`` on the CPU; only the GPU's
compute capability (what upstream's DSA resolution and our admission read) is faked, as an
H200 (SM90) or a B200 (SM100). Under the plugin's flag both H200 defaults pass upstream's
gate, the formats whose translated tables the CPU twins prove: bf16 (``flashmla_sparse`` /
``fa3``) and fp8 (``flashmla_kv`` / ``flashmla_kv``), with EAGLE MTP too (the draft's extend
reads with the prefill kernel, twinned); every other triple is refused naming what is
admitted; upstream's other rules still refuse; flag off, upstream's verdict is unchanged.
"""

import inspect

import pytest
import torch
from sglang.srt.arg_groups import kv_shard_hook as upstream_gate
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.server_args import prepare_server_args

from sglang_cp_hicache.testing.v0_5_23.resolution import PD_PREFILL_CP, resolve
from sglang_cp_hicache.v0_5_23.launch.dsa_backend_rule import ADMITTED, UPSTREAM_ADMITTED
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError

BF16 = ["--kv-cache-dtype", "bfloat16"]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
UPSTREAM_BACKEND_REFUSAL = "DSA KV sharding requires TRTLLM prefill/decode with fp8_e4m3"
HOPPER_ADMITTED = [
    ("flashmla_sparse", "fa3", "bfloat16", 64),
    ("flashmla_kv", "flashmla_kv", "fp8_e4m3", 64),
]
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
         "--speculative-num-steps", "1", "--speculative-num-draft-tokens", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def glm5(glm5_path):
    return ["--model-path", glm5_path, "--device", "cuda", "--tp", "2"] + PD_PREFILL_CP


@pytest.fixture
def sm(monkeypatch):
    """``sm(9)``: resolve as on an H200; ``sm(10)``: a B200."""

    def set_major(major):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (major, 0))

    return set_major


def _backends(record):
    return tuple(
        resolution_result(record, f)
        for f in ("dsa_prefill_backend", "dsa_decode_backend", "kv_cache_dtype", "page_size")
    )


@pytest.mark.parametrize("dtype, expected", [(None, HOPPER_ADMITTED[0]), (FP8, HOPPER_ADMITTED[1])], ids=["bf16", "fp8"])
def test_each_h200_default_is_admitted_under_the_flag(glm5, sm, dtype, expected):
    sm(9)
    with pytest.raises(ValueError, match=UPSTREAM_BACKEND_REFUSAL):  # what a new user met
        resolve(glm5 + (dtype or []) + ["--enable-kv-cache-sharding"])
    record = resolve(glm5 + (dtype or []) + [CLI_FLAG])
    assert _backends(record) == expected
    assert [tuple(vars(b).values()) for b in ADMITTED[9]] == HOPPER_ADMITTED
    assert resolution_result(record, "enable_kv_cache_sharding") is True


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_eagle_mtp_on_an_admitted_hopper_format_is_admitted(glm5, sm, dtype):
    sm(9)
    with pytest.raises(ValueError, match=UPSTREAM_BACKEND_REFUSAL):
        resolve(glm5 + dtype + EAGLE + ["--enable-kv-cache-sharding"])
    record = resolve(glm5 + dtype + EAGLE + [CLI_FLAG])
    assert _backends(record) in HOPPER_ADMITTED
    assert resolution_result(record, "speculative_algorithm") == "EAGLE"


def test_upstreams_triple_is_still_admitted_on_blackwell(glm5, sm):
    sm(10)
    record = resolve(glm5 + FP8 + [CLI_FLAG])
    assert _backends(record) == ("trtllm", "trtllm", "fp8_e4m3", 64)
    assert tuple(vars(UPSTREAM_ADMITTED).values()) == _backends(record)


OUTSIDE = [
    # H200: a decode backend other than the one a prefill worker resolves with the format
    (9, BF16 + ["--dsa-decode-backend", "flashmla_sparse"], "--dsa-prefill-backend flashmla_sparse --dsa-decode-backend flashmla_sparse"),
    (9, FP8 + ["--dsa-prefill-backend", "flashmla_sparse"], "--dsa-prefill-backend flashmla_sparse --dsa-decode-backend flashmla_kv --kv-cache-dtype fp8_e4m3"),
    (9, FP8 + ["--dsa-decode-backend", "fa3"], "--dsa-prefill-backend flashmla_kv --dsa-decode-backend fa3 --kv-cache-dtype fp8_e4m3"),
    (9, BF16 + ["--dsa-prefill-backend", "tilelang", "--dsa-decode-backend", "tilelang"], "--dsa-prefill-backend tilelang"),
    # B200: the Hopper formats are not checked there
    (10, BF16, "--dsa-prefill-backend flashmla_sparse --dsa-decode-backend trtllm --kv-cache-dtype bfloat16"),
    (10, FP8 + ["--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv"], "--dsa-prefill-backend flashmla_kv"),
]  # fmt: skip


@pytest.mark.parametrize("major, extra, got", OUTSIDE, ids=[f"sm{o[0]}-{o[2][22:45]}" for o in OUTSIDE])
def test_outside_the_admitted_set_is_refused_naming_it(glm5, sm, major, extra, got):
    sm(major)
    with pytest.raises(CpSharedKVConfigError) as refused:
        resolve(glm5 + extra + [CLI_FLAG])
    message = str(refused.value)
    assert message.startswith(f"{CLI_FLAG}: DSA KV sharding on SM{major}0 admits ")
    assert f"(got {got}" in message, message
    admitted = [UPSTREAM_ADMITTED] + list(ADMITTED.get(major, ()))
    assert all(b.spelled() in message.split(" (got ")[0] for b in admitted), message
    assert "flashmla_sparse --dsa-decode-backend fa3 --kv-cache-dtype bfloat16" in message  # what Hopper adds
    assert "flashmla_kv --dsa-decode-backend flashmla_kv --kv-cache-dtype fp8_e4m3" in message


UPSTREAM_RULES = [
    (["--enable-dsa-cache-layer-split"], "DSA KV sharding requires Mooncake"),
    (["--disaggregation-transfer-backend", "nixl"], "DSA KV sharding requires Mooncake"),
    (["--pp-size", "2"], "DSA KV sharding requires CUDA interleave prefill CP > 1 and PP1"),
    (["--chunked-prefill-size", "-1"], "requires chunked prefill"),
]


@pytest.mark.parametrize("extra, needle", UPSTREAM_RULES, ids=[r[0][0] for r in UPSTREAM_RULES])
def test_every_other_rule_of_upstreams_gate_still_refuses(glm5, sm, extra, needle):
    sm(9)
    with pytest.raises(ValueError, match=needle) as refused:
        resolve(glm5 + BF16 + extra + [CLI_FLAG])
    assert not isinstance(refused.value, CpSharedKVConfigError)


def test_the_cpu_device_keeps_upstreams_cuda_refusal(glm5, sm):
    sm(9)
    argv = [a if a != "cuda" else "cpu" for a in glm5]
    with pytest.raises(ValueError, match="DSA KV sharding requires CUDA"):
        resolve(argv + [CLI_FLAG])


@pytest.mark.parametrize("major, dtype", [(9, None), (9, FP8), (10, BF16), (10, FP8)])
def test_flag_off_the_backend_rule_is_upstreams(glm5, sm, major, dtype):
    """Upstream's own --enable-kv-cache-sharding: the hooked function gives the verdict
    the unhooked one gives, for the same resolved record."""
    sm(major)
    record = prepare_server_args(glm5 + (dtype or []) + ["--enable-kv-cache-sharding"])
    hooked = upstream_gate.validate_kv_shard_attention_backend
    assert hooked is not inspect.unwrap(hooked)  # the hook is in place

    def verdict(check):
        try:
            check(record)
            return None
        except ValueError as exc:
            return type(exc), str(exc)

    try:
        record.resolve_once()
    except ValueError:
        pass  # resolved up to the gate; both checks judge the same declarations
    assert verdict(hooked) == verdict(inspect.unwrap(hooked))
    assert (verdict(hooked) is None) == ((major, dtype) == (10, FP8))
