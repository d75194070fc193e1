"""Repository-wide pytest set-up: the CPU runtime must be in place before SGLang is imported.

``install()`` adds only what this machine lacks: on a GPU box with a working ``sgl_kernel``
it adds nothing, so tests there run the real kernels on pinned host memory.
"""

import pytest

from sglang_cp_hicache.testing import install

install()


@pytest.fixture(scope="session")
def gloo_world1():
    """A one-rank gloo world: HiRadixCache asks its TP group for a world size.

    Single-process tests build rank ``r`` of a larger CP layout; its cache decisions need
    no collective (that is the point), so no peer ranks are required.
    """
    from sglang_cp_hicache.testing.dist import single_rank_world

    return single_rank_world()


@pytest.fixture(scope="session")
def plugins_loaded():
    """SGLang's own plugin loading with this package's entry point (hooks stay applied)."""
    import sglang.srt.plugins as sglang_plugins

    sglang_plugins._plugins_loaded = False  # guard is process-global
    sglang_plugins.load_plugins()
