"""The Mooncake master unreachable: at startup a fast error naming it; mid-run, batches
answered as failed without the client while it is down, counted (issue 24).

The store is the plugin's real ``OwnerFreeMooncakeStore`` on a real ``HiCacheStorageConfig``
(the probe runs before upstream's setup, so no Mooncake client is built); the master is a
closed or listening loopback port. The mid-run rule with a real master killed after a write
is ``test/registered/multi_rank/v0_5_23/storage/test_storage_mooncake_multi_rank.py``.
"""

import socket
import threading
import time

import pytest

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")

from sglang_cp_hicache.v0_5_23.storage import mooncake_backend as ours  # noqa: E402


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # released: nothing listens there now


def _storage_config(address: str):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=2,
        is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="test-model",
        extra_config={
            "master_server_address": address, "protocol": "tcp",
            "metadata_server": "P2PHANDSHAKE", "local_hostname": "127.0.0.1",
            "global_segment_size": 1 << 20, "check_server": False,
        },
    )  # fmt: skip


def test_an_unreachable_master_stops_startup_in_seconds_naming_it():
    from sglang_cp_hicache.core.storage_keys import StorageNamespace

    port = _closed_port()
    namespace = StorageNamespace(
        model="test-model", kv_dtype="torch.bfloat16", kv_cache_dim=656, layer_num=2,
        host_layout="page_first", page_size=64,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ours.MooncakeMasterUnreachable) as refused:
        ours.OwnerFreeMooncakeStore(_storage_config(f"127.0.0.1:{port}"), namespace)
    elapsed = time.monotonic() - started
    assert f"127.0.0.1:{port}" in str(refused.value)
    assert ours.MASTER_PROBE_TIMEOUT_S - 0.5 <= elapsed < ours.MASTER_PROBE_TIMEOUT_S + 2.0


def test_a_master_that_comes_up_within_the_window_is_accepted():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        threading.Timer(0.5, listener.listen).start()  # a master starting a moment later
        started = time.monotonic()
        ours.probe_master(f"127.0.0.1:{port}")
        assert 0.4 <= time.monotonic() - started < ours.MASTER_PROBE_TIMEOUT_S


@pytest.mark.parametrize("address", [None, "", "etcd://10.0.0.1:2379", "a:1,b:2", "no-port"])
def test_addresses_upstream_resolves_otherwise_are_not_probed(address):
    assert ours.master_host_port(address) is None
    ours.probe_master(address or "")  # returns at once


def test_while_the_master_is_down_no_batch_reaches_the_client(monkeypatch):
    monkeypatch.setattr(ours, "OUTAGE_RECHECK_S", 0.3)
    outage = ours.MasterOutage(f"127.0.0.1:{_closed_port()}")
    calls = []

    def client(results):
        def call():
            calls.append(results)
            return results

        return call

    assert outage.call("batch exists", 2, client([1, 0])) == [1, 0]  # a miss is no outage
    assert not outage.down
    assert outage.call("batch put", 2, client([ours.RPC_FAIL] * 2)) == [ours.RPC_FAIL] * 2
    assert outage.down and outage.failed_batches == 1 and outage.outages == 1
    started = time.monotonic()
    for _ in range(50):
        assert outage.call("batch get", 3, client([64] * 3)) == [ours.RPC_FAIL] * 3
    assert time.monotonic() - started < 0.5  # answered at once, not after a client timeout
    assert len(calls) == 2 and outage.skipped_batches == 50
    time.sleep(0.35)  # a probe is due; the master is still gone
    assert outage.call("batch get", 1, client([64])) == [ours.RPC_FAIL]
    assert len(calls) == 2 and outage.skipped_batches == 51


def test_the_client_is_called_again_once_the_master_listens(monkeypatch):
    monkeypatch.setattr(ours, "OUTAGE_RECHECK_S", 0.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        outage = ours.MasterOutage("127.0.0.1:%d" % listener.getsockname()[1])
        outage.call("batch put", 1, lambda: [ours.RPC_FAIL])
        assert outage.down
        assert outage.call("batch get", 1, lambda: [64]) == [64]
    assert not outage.down and outage.outages == 1 and outage.skipped_batches == 0
    assert outage.reconnects == 1


def test_a_restarted_master_answering_a_stale_link_gets_the_batch_again():
    """A master restarted while this rank sent nothing: the client's first batch over its
    old link answers RPC_FAIL though the master listens (fleet_faults run 3: A's next
    second of backups was then answered failed unsent and its prefix never stored)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        outage = ours.MasterOutage("127.0.0.1:%d" % listener.getsockname()[1])
        answers = [[ours.RPC_FAIL] * 2, [0, 0]]
        assert outage.call("batch put", 2, lambda: answers.pop(0)) == [0, 0]
        assert not answers  # sent twice
        assert outage.call("batch put", 1, lambda: [0]) == [0]  # and the next goes out too
    assert not outage.down and outage.outages == 0 and outage.failed_batches == 1
    assert outage.reconnects == 1 and outage.skipped_batches == 0
