"""The serving benchmark's workloads, as ``bench_serving`` datasets (:class:`Workload`).

* :func:`shared_prefix`: ``generated-shared-prefix`` over token ids (``--tokenize-prompt``, so
  lengths are exact): ``groups`` system prompts of ``system_tokens``, each followed by
  ``prompts_per_group`` questions of ``question_tokens``, shuffled by the seed. Its logical
  working set is the system prompts.
* :class:`Conversations`: multi-turn conversations in the Mooncake trace format, written
  locally (nothing is downloaded) and fed with ``--dataset-name mooncake --dataset-path``.
  ``bench_serving`` builds a record's prompt from its ``hash_ids`` (one text block per id,
  :data:`MOONCAKE_BLOCK_TOKENS` tokens with the tiny tokenizer), so a turn whose ids extend
  the earlier turn's is that turn plus new text. Records go turn by turn (every
  conversation's first turn, then every second turn, ...), a millisecond apart, so a turn is
  sent ``conversations`` requests after its conversation's previous one: at concurrency 1
  once that has finished; at concurrency c only c - 1 requests are still running when it
  starts, and it overlaps its previous turn only if that is one of them (``bench_serving``
  keeps no order within a conversation).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List

from sglang_cp_hicache.testing.server.bench_run import Workload
from sglang_cp_hicache.testing.server.recorder import tokens

#: Tokens of one Mooncake ``hash_id`` block with the tiny tokenizer (``"<id>" + "hi" * 128``,
#: as ``bench_serving`` spells it; measured: 258).
MOONCAKE_BLOCK_TOKENS = 258
#: Ids of one conversation's blocks start at ``conversation * HASH_ID_STRIDE``: no two
#: conversations share a block, so they share no prefix.
HASH_ID_STRIDE = 1000


def shared_prefix(
    groups: int, prompts_per_group: int, system_tokens: int, question_tokens: int, output_tokens: int
) -> Workload:
    """``generated-shared-prefix`` over exact token ids."""
    args = (
        "--dataset-name", "generated-shared-prefix", "--tokenize-prompt",
        "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(prompts_per_group),
        "--gsp-system-prompt-len", str(system_tokens), "--gsp-question-len", str(question_tokens),
        "--gsp-output-len", str(output_tokens), "--num-prompts", str(groups * prompts_per_group),
    )  # fmt: skip
    requests = groups * prompts_per_group
    return Workload("shared-prefix", args, requests, output_tokens, working_set_tokens=groups * system_tokens)


@dataclass(frozen=True)
class Conversations:
    """``conversations`` conversations of ``turns`` turns, each turn ``blocks_per_turn``
    Mooncake blocks longer than the one before, answered with ``output_tokens``."""

    conversations: int = 16
    turns: int = 3
    blocks_per_turn: int = 1
    output_tokens: int = 8

    def records(self) -> List[dict]:
        """The trace: turn by turn, a millisecond apart."""
        records = []
        for turn in range(self.turns):
            blocks = self.blocks_per_turn * (turn + 1)
            for conversation in range(self.conversations):
                first = conversation * HASH_ID_STRIDE
                records.append({
                    "timestamp": len(records),
                    "input_length": blocks * MOONCAKE_BLOCK_TOKENS,
                    "output_length": self.output_tokens,
                    "hash_ids": list(range(first, first + blocks)),
                })  # fmt: skip
        return records

    def longest_prompt(self) -> int:
        return self.turns * self.blocks_per_turn * MOONCAKE_BLOCK_TOKENS

    def workload(self, path: Path) -> Workload:
        """Write the trace to ``path``; the ``bench_serving`` dataset that replays it."""
        records = self.records()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        args = (
            "--dataset-name", "mooncake", "--dataset-path", str(path), "--num-prompts", str(len(records)),
            "--mooncake-num-rounds", "1", "--mooncake-slowdown-factor", "1",
        )  # fmt: skip
        working_set = self.conversations * self.longest_prompt()
        return Workload("conversations", args, len(records), self.output_tokens, working_set_tokens=working_set)


def warm_up_prompts(pages: int, count: int, page_size: int = 64) -> List[List[int]]:
    """``count`` prompts sharing ``pages`` full pages, each a page of its own after them; every
    id in the tiny model's vocabulary (the PD decode refuses any other, see docs/refusals.md)."""
    prefix = tokens("bench warm-up", pages * page_size)
    return [prefix + tokens(f"bench warm-up {i}", page_size) for i in range(count)]


__all__ = ["Conversations", "MOONCAKE_BLOCK_TOKENS", "shared_prefix", "warm_up_prompts"]
