"""The CPU server runtime's torch bodies of EAGLE's ``sgl_kernel`` CPU ops
(``testing/server/spec_kernels.py``) against straightforward references on small inputs:
the draft's own chain (topk 1) built by SGLang's ``select_top_k_tokens`` and
``organize_draft_results`` and laid out by SGLang's ``build_tree_kernel_efficient``; greedy
verify of a chain as "accept while the draft equals the target's prediction", and of a
two-branch tree; the cache-location copies as slicing."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sglang_cp_hicache.testing.server import spec_kernels


def _chain_draft(batch: int, steps: int, seed: int):
    """SGLang's draft bookkeeping for ``steps`` topk-1 steps: (parent_list, top_scores_index,
    draft_tokens), as ``EAGLEWorkerV2.draft`` hands them to the tree build."""
    torch._dynamo.config.disable = True  # _select_top_k_tokens_later is torch.compile'd
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    g = torch.Generator().manual_seed(seed)
    scores, score_list, token_list, parents_list = None, [], [], []
    for step in range(steps):
        p, index = torch.rand(batch, 1, generator=g), torch.randint(0, 1000, (batch, 1), generator=g)
        _, _, scores, (step_scores, step_tokens, step_parents) = select_top_k_tokens(step, p, index, None, scores, 1)
        score_list.append(step_scores)
        token_list.append(step_tokens)
        parents_list.append(step_parents)
    return organize_draft_results(score_list, token_list, parents_list, steps + 1)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("mode", ["QLEN_ONLY", "FULL_MASK"])
def test_a_topk1_draft_builds_a_chain(monkeypatch, steps, mode):
    from sglang.srt.speculative import eagle_utils
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    monkeypatch.setattr(eagle_utils, "build_tree_kernel_efficient_func", spec_kernels.build_tree_kernel_efficient)
    batch, n = 2, steps + 1
    parent_list, top_scores_index, draft_tokens = _chain_draft(batch, steps, seed=steps)
    seq_lens = torch.tensor([5, 9])
    bonus = torch.tensor([7, 8])
    mask, positions, index, next_token, next_sibling, tokens = eagle_utils.build_tree_kernel_efficient(
        bonus, parent_list, top_scores_index, draft_tokens, seq_lens, int(seq_lens.sum()),
        1, steps, n, TreeMaskMode[mode],
    )  # fmt: skip
    assert tokens.tolist() == torch.cat([bonus[:, None], draft_tokens], 1).flatten().tolist()
    assert positions.tolist() == [int(s) + i for s in seq_lens for i in range(n)]
    assert index.tolist() == [[b * n + i for i in range(n)] for b in range(batch)]
    assert next_token.tolist() == [[*range(1, n), -1]] * batch
    assert next_sibling.tolist() == [[-1] * n] * batch
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if mode == "QLEN_ONLY":
        assert torch.equal(mask.view(batch, n, n), causal.expand(batch, n, n))
        return
    offset = 0
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = mask[offset : offset + n * (seq_len + n)].view(n, seq_len + n)
        assert rows[:, :seq_len].all() and torch.equal(rows[:, seq_len:], causal)
        offset += n * (seq_len + n)


def _chain_verify_reference(candidates: List[int], targets: List[int], row: int):
    """Accept draft ``i + 1`` while it equals the target's prediction at slot ``i``."""
    n = len(candidates)
    accepted = 0
    while accepted + 1 < n and candidates[accepted + 1] == targets[accepted]:
        accepted += 1
    return accepted, [row * n + i for i in range(accepted + 1)] + [-1] * (n - 1 - accepted)


def _verify(candidates, index, next_token, next_sibling, targets, steps):
    batch, n = candidates.shape
    predicts = torch.zeros(batch * n, dtype=torch.int32)
    accept_index = torch.full((batch, steps), -1, dtype=torch.int32)
    accepted = torch.empty(batch, dtype=torch.int32)
    spec_kernels.verify_tree_greedy(predicts, accept_index, accepted, candidates, index, next_token, next_sibling, targets)
    return predicts, accept_index, accepted


@pytest.mark.parametrize("matches", [0, 1, 2, 3])
def test_greedy_verify_of_a_chain_accepts_the_matching_prefix(matches):
    batch, n = 3, 4
    g = torch.Generator().manual_seed(matches)
    targets = torch.randint(10, 50, (batch, n), generator=g)
    candidates = torch.randint(60, 90, (batch, n), generator=g)  # never a target
    lengths = [matches, 0, n - 1]
    for b, length in enumerate(lengths):
        candidates[b, 1 : 1 + length] = targets[b, :length]
    index = torch.arange(batch * n).view(batch, n)
    next_token = torch.tensor([[*range(1, n), -1]] * batch)
    next_sibling = torch.full((batch, n), -1)
    predicts, accept_index, accepted = _verify(candidates, index, next_token, next_sibling, targets, n)
    for b in range(batch):
        want, want_index = _chain_verify_reference(candidates[b].tolist(), targets[b].tolist(), b)
        assert accepted[b] == want == lengths[b]
        assert accept_index[b].tolist() == want_index
        kept = [b * n + i for i in range(want + 1)]
        assert predicts[kept].tolist() == targets[b, : want + 1].tolist()


def test_greedy_verify_of_a_tree_follows_the_matching_sibling():
    # root 0 -> children 1, 2 (sibling order); 2 -> child 3
    candidates = torch.tensor([[5, 11, 12, 13]])
    next_token, next_sibling = torch.tensor([[1, -1, 3, -1]]), torch.tensor([[-1, 2, -1, -1]])
    targets = torch.tensor([[12, 40, 13, 44]])  # at root: 12 (slot 2); at slot 2: 13 (slot 3)
    predicts, accept_index, accepted = _verify(candidates, torch.arange(4)[None], next_token, next_sibling, targets, 3)
    assert accepted.tolist() == [2] and accept_index.tolist() == [[0, 2, 3]]
    assert predicts[[0, 2, 3]].tolist() == [12, 13, 44]


def test_bonus_tokens_are_each_rows_last_accepted_token():
    accept_tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    bonus = torch.empty(2, dtype=torch.int32)
    spec_kernels.fill_bonus_tokens(accept_tokens, torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [2, 6]


def test_accepted_cache_locations_are_packed_in_order():
    out = torch.zeros(6, dtype=torch.int64)
    spec_kernels.fill_accept_out_cache_loc(torch.tensor([[0, 1, -1], [3, -1, -1]]), torch.arange(100, 106), out)
    assert out.tolist() == [100, 101, 103, 0, 0, 0]


def test_cache_location_copies_are_slices_of_req_to_token():
    table = torch.arange(40).view(4, 10).to(torch.int32)
    out = torch.empty(4, dtype=torch.int64)
    spec_kernels.assign_draft_cache_locs_contiguous(torch.tensor([2, 0]), table, torch.tensor([3, 7]), out, 10, 1, 2)
    assert out.tolist() == [23, 24, 7, 8]
    packed = torch.zeros(5, dtype=torch.int64)
    spec_kernels.assign_extend_cache_locs(
        torch.tensor([1, 3]), table, torch.tensor([2, 0]), torch.tensor([4, 3]), packed, 10
    )
    assert packed.tolist() == [12, 13, 30, 31, 32]


def test_the_prefill_page_table_transform_reads_an_expanded_table_per_query():
    """EAGLE's target verify and draft extend hand ``transform_index_page_table_prefill`` a
    page table with one row per query (``page_table_is_expanded``): each query maps its
    selected positions through its own row, not its request's first."""
    from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import transform_index_page_table_prefill_reference

    per_query = torch.arange(16, dtype=torch.int32).view(4, 4) + 100  # rows differ per query
    topk = torch.tensor([[0, 2, -1], [1, 3, 0], [3, -1, -1], [2, 1, 0]], dtype=torch.int32)
    got = transform_index_page_table_prefill_reference(per_query, topk, [2, 2], output_num_tokens=5, page_table_is_expanded=True)
    assert got.tolist() == [[100, 102, -1], [105, 107, 104], [111, -1, -1], [114, 113, 112], [-1, -1, -1]]
    by_request = transform_index_page_table_prefill_reference(per_query[[0, 2]], topk, [2, 2])
    assert by_request.tolist() == [[100, 102, -1], [101, 103, 100], [111, -1, -1], [110, 109, 108]]
