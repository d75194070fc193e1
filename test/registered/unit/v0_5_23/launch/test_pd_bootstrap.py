"""``v0_5_23.launch.pd_bootstrap``: the prefill's registration with its bootstrap
server, AROUND upstream's ``CommonKVManager._register_topology_row``.

Flag off: upstream's method, called once with the same arguments, even for an address
nobody serves. Flag on and the address unreachable: one error naming host:port, upstream's
registration never tried. Flag on and the address served: upstream's registration, called
once with the same arguments (a prefill that skips it is never found by a decode, which
only a long PD hang showed before). (The whole path, with the real KV manager in prefill rank
processes: ``multi_rank/v0_5_23/native/test_pd_mooncake_transfer.py``.)
"""

from __future__ import annotations

import socket
from unittest.mock import MagicMock

import pytest

from sglang_cp_hicache.core import bootstrap_probe
from sglang_cp_hicache.core.bootstrap_probe import PDBootstrapUnreachable
from sglang_cp_hicache.v0_5_23.launch.pd_bootstrap import register_topology_row_around


# A prefill worker's arguments, the shape the plugin's flag accepts.
PREFILL_ARGV = ["--model-path", "dummy", "--enable-prefill-cp", "--cp-strategy", "interleave",
                "--disaggregation-mode", "prefill"]  # fmt: skip


@pytest.fixture
def publish(monkeypatch, plugins_loaded):
    """Publishes a resolved prefill record with or without the plugin's flag (parsed and
    resolved as SGLang does, the plugin loaded); restores the context after."""
    from sglang.srt.runtime_context import restore_context, snapshot_context
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

    monkeypatch.setattr(bootstrap_probe, "REGISTRATION_WAIT_S", 0.5)
    before = snapshot_context()

    def publish_record(flag: bool) -> None:
        record = prepare_server_args(PREFILL_ARGV + ([CLI_FLAG] if flag else []))
        set_global_server_args_for_scheduler(record)

    try:
        yield publish_record
    finally:
        restore_context(before)


def _unserved_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/route"


def test_flag_off_is_upstreams_registration(publish) -> None:
    publish(False)
    original, manager, url, payload = MagicMock(return_value=None), MagicMock(), _unserved_url(), {"a": 1}
    assert register_topology_row_around(original, manager, url, payload) is None
    original.assert_called_once_with(manager, url, payload)
    assert manager.mock_calls == []


def test_flag_on_a_reachable_bootstrap_gets_upstreams_registration(publish) -> None:
    publish(True)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        url, payload = f"http://127.0.0.1:{server.getsockname()[1]}/route", {"attn_cp_rank": 1}
        original, manager = MagicMock(return_value=None), MagicMock()
        assert register_topology_row_around(original, manager, url, payload) is None
    original.assert_called_once_with(manager, url, payload)
    assert manager.mock_calls == []


def test_flag_on_an_unreachable_bootstrap_raises_naming_it(publish) -> None:
    publish(True)
    original, url = MagicMock(), _unserved_url()
    with pytest.raises(PDBootstrapUnreachable, match=url.split("/")[2]):
        register_topology_row_around(original, MagicMock(), url, {})
    original.assert_not_called()
