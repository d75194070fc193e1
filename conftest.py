"""Repository-wide pytest set-up: the CPU runtime must be in place before SGLang is imported."""

import datetime
import os
import tempfile

import pytest

from sglang_cp_hicache.testing import install

install()


@pytest.fixture(scope="session")
def gloo_world1():
    """A one-rank gloo world: HiRadixCache asks its TP group for a world size.

    Single-process tests build rank ``r`` of a larger CP layout; its cache decisions need
    no collective (that is the point), so no peer ranks are required.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="gloo-"), "store")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    return dist.group.WORLD


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own plugin loading with this package's entry point (hooks stay applied)."""
    import sglang.srt.plugins as sglang_plugins

    sglang_plugins._plugins_loaded = False  # guard is process-global
    sglang_plugins.load_plugins()
