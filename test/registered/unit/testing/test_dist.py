"""``testing/dist.py``'s one-rank world: a working gloo group that leaves nothing behind.
Runs in both venvs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_single_rank_world_reduces_and_leaves_no_file_when_the_process_ends(tmp_path):
    """Every single-process test and benchmark builds this world; a store file per process
    filled the CI machine's /tmp with hundreds of folders."""
    body = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from sglang_cp_hicache.testing.dist import single_rank_world
        group = single_rank_world()
        tensor = torch.ones(3)
        dist.all_reduce(tensor, group=group)
        assert dist.get_world_size(group) == 1 and tensor.tolist() == [1.0, 1.0, 1.0]
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", body], env=env, check=True, timeout=120)
    assert list(tmp_path.iterdir()) == []
