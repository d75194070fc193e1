"""Draft (MTP) KV is never dropped silently: a CP HiCache built for a speculative server is
refused where it is built, until draft host KV is kept in lockstep with the target's."""

import pytest

from sglang_cp_hicache.server_args import CpSharedKVConfigError
from sglang_cp_hicache.testing import nsa_stack


def test_cp_hicache_for_a_speculative_server_is_refused_where_it_is_built(gloo_world1, monkeypatch):
    build_args = nsa_stack._server_args

    def with_draft(cfg):
        server_args = build_args(cfg)
        server_args.speculative_algorithm = "EAGLE"
        return server_args

    monkeypatch.setattr(nsa_stack, "_server_args", with_draft)
    cfg = nsa_stack.StackConfig(physical_tokens=64 * 16)
    with pytest.raises(CpSharedKVConfigError, match="draft KV on host is not yet kept in lockstep"):
        nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    # Upstream HiCache (no CP allocator) is none of the plugin's business.
    nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False).close()
