"""unsupported_serving_modes: what the shared-KV attention runtime refuses at startup."""

from types import SimpleNamespace

import pytest

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_support import (
    ALL_CP_RANKS_TRANSFER_ENV,
    unsupported_serving_modes,
)


def _args(**overrides):
    base = dict(
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        speculative_algorithm=None,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        enforce_piecewise_cuda_graph=False,
        nsa_prefill_backend=None,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


@pytest.fixture
def all_ranks_transfer(monkeypatch):
    monkeypatch.setenv(ALL_CP_RANKS_TRANSFER_ENV, "1")


def test_pd_prefill_with_mooncake_and_all_rank_transfer_is_supported(all_ranks_transfer):
    assert unsupported_serving_modes(_args()) == []
    assert unsupported_serving_modes(_args(nsa_prefill_backend="flashmla_kv")) == []
    # The NSA MTP draft's prefill extend runs through the same runtime (checked with the
    # flag's other combinations in server_args).
    assert unsupported_serving_modes(_args(speculative_algorithm="EAGLE")) == []


def test_real_server_args_object(all_ranks_transfer):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", disaggregation_mode="prefill")
    assert unsupported_serving_modes(args) == []


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(disaggregation_mode="null"), "--disaggregation-mode prefill"),
        (dict(disaggregation_transfer_backend="nixl"), "Mooncake"),
        (dict(enable_two_batch_overlap=True), "two-batch"),
        (dict(enable_pdmux=True), "pdmux"),
        (dict(enforce_piecewise_cuda_graph=True), "piecewise"),
        (dict(nsa_prefill_backend="tilelang"), "nsa-prefill-backend"),
        (dict(nsa_prefill_backend="trtllm"), "nsa-prefill-backend"),
    ],
)
def test_each_unsupported_mode_is_named(all_ranks_transfer, overrides, needle):
    problems = unsupported_serving_modes(_args(**overrides))
    assert len(problems) == 1 and needle in problems[0]


def test_single_rank_transfer_is_refused(monkeypatch):
    monkeypatch.delenv(ALL_CP_RANKS_TRANSFER_ENV, raising=False)
    problems = unsupported_serving_modes(_args())
    assert len(problems) == 1 and ALL_CP_RANKS_TRANSFER_ENV in problems[0]
