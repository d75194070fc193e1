"""core.storage_keys: owner-free L3 keys and the logical progress of an owned-subset read."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.core.storage_keys import (
    COMPONENTS,
    StorageNamespace,
    component_of_pool,
    logical_pages_completed,
)


def make_namespace(**changes) -> StorageNamespace:
    base = StorageNamespace(
        model="zai-org/GLM-5", kv_dtype="torch.bfloat16", kv_cache_dim=576, layer_num=78,
        host_layout="layer_first", page_size=64,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    "field,value",
    [("model", "deepseek-ai/DeepSeek-V3.2"), ("kv_dtype", "torch.float8_e4m3fn"),
     ("kv_cache_dim", 656), ("layer_num", 61), ("host_layout", "page_first"),
     ("page_size", 32), ("extra", "tag"), ("format_version", 2)],
)  # fmt: skip
def test_every_namespace_field_changes_the_key(field, value):
    key = make_namespace().object_key("kv", "abc")
    assert make_namespace(**{field: value}).object_key("kv", "abc") != key


def test_key_is_deterministic_and_ends_with_the_namespace_suffix():
    ns = make_namespace()
    assert ns.object_key("indexer", "abc") == make_namespace().object_key("indexer", "abc")
    assert ns.object_key("indexer", "abc").endswith(ns.key_suffix)
    assert ns.object_key("indexer", "abc").startswith("abc.indexer")


def test_components_are_distinct_objects_of_one_page():
    ns = make_namespace()
    keys = {ns.object_key(component, "abc") for component in COMPONENTS}
    assert len(keys) == len(COMPONENTS)


def test_no_owner_or_cp_field_exists():
    names = {f.name for f in dataclasses.fields(StorageNamespace)}
    assert not names & {"cp_size", "cp_rank", "owner", "attn_cp_rank", "attn_cp_size"}


@pytest.mark.parametrize("bad", ["", "a.b", "a__b"])
def test_malformed_page_hash_is_refused(bad):
    with pytest.raises(ValueError):
        make_namespace().object_key("kv", bad)


def test_unknown_component_and_bad_geometry_are_refused():
    with pytest.raises(ValueError):
        make_namespace().object_key("mamba", "abc")
    with pytest.raises(ValueError):
        make_namespace(page_size=0)
    with pytest.raises(ValueError):
        make_namespace(model="")


def test_pool_names_map_to_components():
    assert [component_of_pool(n) for n in (None, "kv", "indexer", "draft", "draft_indexer")] == [
        "kv", "kv", "indexer", "draft_kv", "draft_indexer"
    ]  # fmt: skip
    with pytest.raises(ValueError):
        component_of_pool("swa")


@pytest.mark.parametrize("pages,cp", [(p, c) for p in (1, 3, 8) for c in (1, 2, 4)])
def test_min_over_ranks_is_the_prefix_every_owner_read(pages, cp):
    """Exhaustive over one failing page per rank (or none): the MIN of every rank's report
    is the first page whose owner failed to read it."""
    owners = [owner_of(3, p, cp) for p in range(pages)]
    for failures in itertools.product(*[range(-1, pages) for _ in range(cp)]):
        reports, truth = [], pages
        for rank, fail_at in enumerate(failures):
            owned = [o == rank for o in owners]
            if fail_at >= 0 and owned[fail_at]:
                read = sum(owned[:fail_at])
                truth = min(truth, fail_at)
            else:
                read = sum(owned)
            reports.append(logical_pages_completed(owned, read))
        assert min(reports) == truth


def test_zero_owned_rank_reports_the_whole_run():
    assert logical_pages_completed([False, False, False], 0) == 3
    assert logical_pages_completed([], 0) == 0


def test_overcount_is_refused():
    with pytest.raises(ValueError):
        logical_pages_completed([True, False], 2)
