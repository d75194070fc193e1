"""The CP write-ack path (``check_hicache_events`` after a backup) commits what the page
table would say, without asking it: a node committed whole takes the load plan its
reservation made (``PendingHostWrite.load_plan``), equal field by field to the table's
``plan_load`` of its host value (with and without the MTP draft on host, zero-owned nodes
too), and the check reads no table plan; a node split while pending still gets the table's
plans. Load-backs through these plans move the right bytes: ``test_cp_hiradix_cache.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


@pytest.fixture(params=[False, True], ids=["target", "with_draft"])
def stack(request, gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, layer_num=2, physical_tokens=PS * 32, draft=request.param)
    built = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    yield built
    built.close()


def _tokens(start: int, num_pages: int) -> list:
    return list(range(start, start + num_pages * PS))


def _plan_fields(plan) -> tuple:
    run = plan.host_run
    page_of_loc = None if run.page_of_loc is None else run.page_of_loc.tolist()
    owners = plan.page_owners.tolist()
    fields = (run.locs.tolist(), run.pages.tolist(), page_of_loc, run.page_size, owners, list(plan.lane_pages))
    return fields + (plan.owned_host_locs.tolist(),)


def _table_plan(cache, node):
    return cache.host_table.plan_load(host_int64(node.host_value), node.id)


def test_committed_plans_equal_the_tables_and_the_check_reads_none(stack, monkeypatch):
    cache = stack.cache
    lane1_only = stack.allocator.alloc_pages_with_owners(torch.ones(2, dtype=torch.int64))
    nodes = [
        nsa_stack.insert_at_root(stack, _tokens(1000, 1)),
        nsa_stack.insert_at_root(stack, _tokens(5000, 3)),
        nsa_stack.insert_at_root(stack, _tokens(9000, 2), lane1_only),  # this rank owns none
        nsa_stack.insert_at_root(stack, _tokens(20000, 5)),
    ]
    assert set(cache.ongoing_write_through) == {node.id for node in nodes}
    table = cache.host_table
    with monkeypatch.context() as patch:  # the ack path plans nothing through the table
        patch.setattr(table, "plan_load", lambda *a, **k: pytest.fail("plan_load on the ack path"))
        cache.check_hicache_events()
    assert not cache.ongoing_write_through and cache.pending_stats.committed == len(nodes)
    for node in nodes:
        expected = _table_plan(cache, node)
        assert _plan_fields(node.cp_host_plan) == _plan_fields(expected), node.id
        assert node.cp_host_lanes == expected.lane_pages
        assert node.cp_host_plan_source is node.host_value
    assert nodes[2].cp_host_lanes == [0, 2]


def test_a_node_split_while_pending_gets_the_tables_plans(stack):
    cache = stack.cache
    tokens = _tokens(3000, 4)
    with device_module().hold_events() as hold:
        node = nsa_stack.insert_at_root(stack, tokens)
        cache.check_hicache_events()
        assert node.id in cache.ongoing_write_through
        # An insert of the first two pages plus a new one splits the pending node.
        head_value = torch.cat([node.value[: 2 * PS], stack.allocator.alloc(PS)])
        key = nsa_stack.radix_key(tokens[: 2 * PS] + _tokens(70000, 1))
        cache.insert(InsertParams(key=key, value=head_value))
        hold.release()
    cache.check_hicache_events()
    head = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens[: 2 * PS]))).last_device_node
    assert head is not node and node.parent is head and node.backuped and head.backuped
    for part in (head, node):
        assert len(part.host_value) == 2 * PS
        assert _plan_fields(part.cp_host_plan) == _plan_fields(_table_plan(cache, part))
    assert np.array_equal(
        np.concatenate([host_int64(head.host_value), host_int64(node.host_value)]),
        np.concatenate([head.cp_host_plan.host_run.locs, node.cp_host_plan.host_run.locs]),
    )
