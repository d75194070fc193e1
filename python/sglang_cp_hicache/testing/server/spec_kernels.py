"""Torch bodies of the ``sgl_kernel`` CPU ops SGLang's EAGLE worker calls (test-only).

SGLang's CPU engine routes EAGLE's tree build, greedy verify and cache-location copies to
``sgl_kernel``'s ``*_cpu`` ops (``kernels/ops/speculative/{spec_tree,eagle,cache_locs}.py``),
which the CPU server runtime's stand-in ``sgl_kernel`` has no body for. Each function here is
the Triton kernel upstream runs for the same call on other devices, ported loop for loop
(one program per request becomes one loop iteration), with the ``*_cpu`` op's argument order:

* :func:`build_tree_kernel_efficient`: ``sgl_build_tree_kernel_efficient_triton`` (retrieve
  links, positions, the tree mask in ``FULL_MASK`` or ``QLEN_ONLY`` mode);
* :func:`verify_tree_greedy`: ``verify_tree_greedy_kernel_triton`` (walk the tree, accept a
  child whose draft token is the target's prediction at its parent);
* :func:`fill_bonus_tokens`, :func:`fill_accept_out_cache_loc`,
  :func:`assign_draft_cache_locs_contiguous`, :func:`assign_extend_cache_locs`: the
  ``eagle.py`` / ``cache_locs.py`` kernels of the same names.

Batches on a CPU server are a few requests of a few draft tokens: plain Python loops over
``tolist()`` copies, results written back into the caller's (mutable) tensors.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

FULL_MASK, QLEN_ONLY = 0, 1  # ``TreeMaskMode`` values the ports serve (no bit packing)


def _parent_position(selected: List[int], parents: List[int], index: int, topk: int, width: int) -> int:
    """Where the parent of tree slot ``index + 1`` sits among the selected tokens, plus one
    (0: the root); -1 where it is not among them."""
    parent_tb = selected[index] // topk
    if parent_tb == 0:
        return 0
    token = parents[parent_tb]
    for position in range(width - 1):
        if selected[position] == token:
            return position + 1
    return -1


def _tree_links(
    selected: List[int], parents: List[int], topk: int, width: int, next_token: List[int], next_sibling: List[int]
) -> None:
    """One request's first-child / next-sibling links (children linked newest first)."""
    for i in range(width - 1, 0, -1):
        parent = _parent_position(selected, parents, i - 1, topk, width)
        if parent < 0:
            continue
        if next_token[parent] != -1:
            next_sibling[i] = next_token[parent]
        next_token[parent] = i


def _ancestor_path(selected: List[int], parents: List[int], token: int, topk: int, depth: int, width: int) -> List[int]:
    """Tree slots (minus one) on the path from draft token ``token`` up to the root's child."""
    path, current = [], token - 1
    for _ in range(depth):
        path.append(current)
        parent = _parent_position(selected, parents, current, topk, width)
        if parent <= 0:
            break
        current = parent - 1
    return path


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """``build_tree_kernel_efficient_cpu``: per request ``b`` of ``n = draft_token_num``
    slots, ``retrieve_index[b, i] = b * n + i``, the first-child / next-sibling links, each
    slot's position (the verified length plus its depth) and its mask row (itself and its
    ancestors; ``FULL_MASK`` rows also see the verified prefix, which the caller filled)."""
    if int(tree_mask_mode) not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(f"build_tree_kernel_efficient (CPU port): tree mask mode {int(tree_mask_mode)}")
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    mask = tree_mask.view(-1)
    prefix_sum = 0
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b].tolist()
        parents = parent_list[b].tolist() if parent_list.numel() else []
        next_token, next_sibling = [-1] * n, [-1] * n
        _tree_links(selected, parents, topk, n, next_token, next_sibling)
        retrieve_index[b] = torch.arange(b * n, (b + 1) * n, dtype=retrieve_index.dtype)
        retrieve_next_token[b] = torch.tensor(next_token, dtype=retrieve_next_token.dtype)
        retrieve_next_sibling[b] = torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype)
        for token in range(n):
            if int(tree_mask_mode) == FULL_MASK:
                row = n * n * b + prefix_sum * n + (seq_len + n) * token + seq_len
            else:
                row = n * n * b + n * token
            mask[row : row + n] = False
            mask[row] = True
            path = _ancestor_path(selected, parents, token, topk, depth, n) if token else []
            for slot in path:
                mask[row + 1 + slot] = True
            positions[b * n + token] = seq_len + len(path)
        prefix_sum += seq_len


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """``verify_tree_greedy_cpu``: from each request's root, repeatedly accept the first child
    (in sibling order) whose draft token equals the target's prediction at the last accepted
    slot, at most ``accept_index.shape[1] - 1`` times; ``predicts`` gets the target's token
    at every accepted slot, ``accept_index`` the accepted slots (the root first),
    ``accept_token_num`` how many drafts were accepted."""
    batch, n = candidates.shape
    steps = accept_index.shape[1]
    targets = target_predict.reshape(-1).tolist()
    for b in range(batch):
        index, draft = retrive_index[b].tolist(), candidates[b].tolist()
        next_token, next_sibling = retrive_next_token[b].tolist(), retrive_next_sibling[b].tolist()
        last = index[0]
        accepted, current = [last], 0
        for _ in range(1, steps):
            current = next_token[current]
            while current != -1 and draft[current] != targets[last]:
                current = next_sibling[current]
            if current == -1:
                break
            predicts[last] = targets[last]
            last = index[current]
            accepted.append(last)
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
        predicts[last] = targets[last]


def fill_bonus_tokens(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """``fill_bonus_tokens_cpu``: request ``b``'s last accepted token (``accept_lens``
    counts the bonus token) out of its row of ``accept_stride`` tokens."""
    flat = accept_tokens.reshape(-1)
    for b, length in enumerate(accept_lens.tolist()):
        bonus_tokens[b] = flat[accept_stride * b + length - 1]


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """``fill_accept_out_cache_loc_cpu``: the cache locations of the accepted slots
    (``accept_index`` entries other than -1, in order), packed from the front."""
    valid = [slot for slot in accept_index.reshape(-1).tolist() if slot > -1]
    if valid:
        accept_out_cache_loc[: len(valid)] = out_cache_loc[torch.tensor(valid)]


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """``assign_draft_cache_locs_contiguous_cpu``: request ``b``'s ``topk * num_cols`` slots
    of ``req_to_token`` from its length on, into its block of ``out_cache_loc``."""
    span = topk * num_cols
    table = req_to_token.reshape(-1, pool_len)
    for b, (req, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[b * span : (b + 1) * span] = table[req, start : start + span]


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``assign_extend_cache_locs_cpu``: ``req_to_token[req, start:end]`` of every request,
    packed one after the other into ``out_cache_loc``."""
    table = req_to_token.reshape(-1, pool_len)
    taken = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[taken : taken + end - start] = table[req, start:end]
        taken += end - start


#: ``sgl_kernel`` name -> torch body, for the stand-in module.
EAGLE_BODIES: Dict[str, Callable] = {
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient,
    "verify_tree_greedy_cpu": verify_tree_greedy,
    "fill_bonus_tokens_cpu": fill_bonus_tokens,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs,
}

__all__ = [
    "EAGLE_BODIES",
    "assign_draft_cache_locs_contiguous",
    "assign_extend_cache_locs",
    "build_tree_kernel_efficient",
    "fill_accept_out_cache_loc",
    "fill_bonus_tokens",
    "verify_tree_greedy",
]
