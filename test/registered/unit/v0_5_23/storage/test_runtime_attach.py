"""Runtime attach of an L3 backend (the admin API's path, upstream's
``StorageAttachment.attach``) on a sharded 0.5.23 HiCache stack started without storage:
the verdicts (cp 2, two gloo ranks; the byte path is
``test/registered/multi_rank/v0_5_23/storage/test_storage_attach_multi_rank.py``).

With the plugin's flag, a backend other than file / mooncake is refused with the startup
refusal's message (naming the flag and the admitted backends), and nothing changes; so is
mooncake on layer_first host pools (a launch with it resolves to page_first; upstream's
attach would succeed and every backup then fail in its thread). With the flag off and
``--enable-kv-cache-sharding``, upstream's refusal stands, word for word.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

UPSTREAM_REFUSAL = "--enable-kv-cache-sharding does not support a HiCache storage backend yet."
REFUSED_BACKENDS = ("hf3fs", "nixl", "dynamic")


def _storage_state(stack) -> Tuple[object, ...]:
    """What an attach changes: storage on, the backend, its type, the policies."""
    cache, controller = stack.cache, stack.controller
    return (
        cache.enable_storage, controller.storage_backend, controller.storage_backend_type,
        cache.prefetch_stop_policy, controller.write_policy,
    )  # fmt: skip


def verdicts(ctx: RankContext, flag: bool, backends: Tuple[str, ...]) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    with sharded_stack(ctx, StackConfig(cp_shared_kv=flag)) as stack:
        before = _storage_state(stack)
        assert before[:3] == (False, None, None), before
        for backend in backends:
            ok, message = storage.attach_at_runtime(stack, backend)
            report[backend] = (ok, message, _storage_state(stack) == before)
    return report


@pytest.fixture(scope="module")
def flag_on() -> List[Dict[str, object]]:
    return run_ranks(2, verdicts, True, REFUSED_BACKENDS + ("mooncake",))  # layer_first


@pytest.mark.parametrize("backend", REFUSED_BACKENDS)
def test_the_flag_refuses_other_backends_with_the_startup_message(flag_on, backend):
    from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

    for rank, report in enumerate(flag_on):
        ok, message, untouched = report[backend]
        assert not ok, f"rank {rank}"
        assert message.startswith(f"{CLI_FLAG}: "), message
        assert f"--hicache-storage-backend file or mooncake only (got {backend})" in message
        assert UPSTREAM_REFUSAL not in message
        assert untouched, f"rank {rank}: a refused attach left state behind"


def test_flag_off_sharding_keeps_upstreams_refusal():
    for rank, report in enumerate(run_ranks(2, verdicts, False, ("file", "mooncake", "hf3fs"))):
        for backend, (ok, message, untouched) in report.items():
            assert (ok, message) == (False, UPSTREAM_REFUSAL), f"rank {rank} {backend}"
            assert untouched, f"rank {rank} {backend}"


def test_the_flag_refuses_mooncake_on_layer_first_host_pools(flag_on):
    from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

    for rank, report in enumerate(flag_on):
        ok, message, untouched = report["mooncake"]
        assert not ok and untouched, f"rank {rank}: {message}"
        assert message.startswith(f"{CLI_FLAG}: --hicache-storage-backend mooncake needs the "
                                  "page_first host layout"), message
        assert "host pools are layer_first" in message
        assert "restart with --hicache-mem-layout page_first" in message
