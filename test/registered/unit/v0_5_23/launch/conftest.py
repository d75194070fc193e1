"""Resolution tests of the 0.5.23 gate rules: the plugin loaded as SGLang loads it, a tiny
GLM-5 model folder per module, and an H200 for the rules that ask the GPU."""

import pytest
import torch

from sglang_cp_hicache.testing.v0_5_23.resolution import write_tiny_glm5


@pytest.fixture(autouse=True)
def _plugins(plugins_loaded):
    """Resolution runs with the plugin loaded the way SGLang loads it."""


@pytest.fixture
def h200(monkeypatch):
    """DSA resolution and the plugin's backend rule ask the GPU for its SM (9: an H200)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))


@pytest.fixture(scope="module")
def glm5_path(tmp_path_factory):
    return write_tiny_glm5(tmp_path_factory.mktemp("glm5"))
