"""Repository-wide pytest set-up: the CPU runtime must be in place before SGLang is imported.

``install()`` runs the installed SGLang release's CPU runtime and adds only what this
machine lacks: on a GPU box with a working kernel package it adds nothing, so tests there
run the real kernels on pinned host memory.

Tests are split by line (``test/registered/{unit,multi_rank}/v0_5_12``, ``.../v0_5_23``);
the other line's folders are not collected, so ``pytest test/registered`` in either venv runs
that line's suite and the shared ``core`` tests.
"""

import pytest

from sglang_cp_hicache.core.releases import LINES, line_package
from sglang_cp_hicache.testing import install, warm_import

install()
# SGLang's cache stack first, as a scheduler imports it: a test that imports one of the
# plugin's cache modules before SGLang's own would have the REPLACE hook resolve the plugin's
# module while it is still being imported (a circular import that only a subset run hits).
warm_import()

_THIS_LINE = line_package().rsplit(".", 1)[1]
collect_ignore_glob = [
    f"test/registered/*/{line}/*" for line in sorted(set(LINES.values())) if line != _THIS_LINE
]


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
