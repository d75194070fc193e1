"""Which host pools the per-layer D2H backup serves, read once at set-up on SGLang 0.5.23's
real host pools (unsharded stack, one gloo rank): layer_first and page_first (0.5.23's
default, through the JIT one-layer kernel) have a one-layer path; page_first_direct has
none and is named (set-up and ``attach`` raise ``PerLayerBackupUnavailable`` with it)."""

from __future__ import annotations

import pytest

CASES = {
    # (io backend, layout): what per_layer_problem says (None: a one-layer path exists)
    ("kernel", "layer_first"): None,
    ("kernel", "page_first"): None,
    ("direct", "layer_first"): None,
    ("direct", "page_first_direct"): "host layout 'page_first_direct': SGLang 0.5.23 has no one-layer D2H op into it",
}


@pytest.mark.parametrize("io_backend, layout", sorted(CASES))
def test_a_one_layer_path_exists_exactly_where_upstream_or_the_jit_kernel_has_one(
    gloo_world1, io_backend: str, layout: str
) -> None:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack
    from sglang_cp_hicache.v0_5_23.backup.l2_transfer import per_layer_problem

    config = StackConfig(device_pages_per_rank=4, io_backend=io_backend, mem_layout=layout)
    with build_unsharded_stack(gloo_world1, config) as stack:
        problem = per_layer_problem(stack.controller)
    expected = CASES[(io_backend, layout)]
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.startswith(expected), problem


def test_page_first_without_the_jit_kernel_for_the_latent_rows_is_refused(gloo_world1) -> None:
    """A part where the latent rows have no JIT kernel (``can_use_jit`` False: upstream's
    page_first one-layer backup raises there) is named with its row size."""
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack
    from sglang_cp_hicache.v0_5_23.backup.l2_transfer import per_layer_problem

    with build_unsharded_stack(gloo_world1, StackConfig(device_pages_per_rank=4, mem_layout="page_first")) as stack:
        stack.kv_host_pool.can_use_jit = False  # what the pool computes on such a part
        problem = per_layer_problem(stack.controller)
    assert problem is not None and "without the JIT one-layer kernel for 1152-byte latent rows" in problem
