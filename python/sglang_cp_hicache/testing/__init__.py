"""CPU runtime: lets the real SGLang cache stack of the installed release run on a machine
without a GPU, for tests and the simulator.

Each line has its own runtime (``testing.v0_5_12.runtime``, ``testing.v0_5_23.runtime``):
what SGLang lacks on CPU differs per release. :func:`install` runs the installed release's
runtime; it must run before ``sglang`` is imported and installs only what this process is
missing. What both runtimes share lives beside this module: the torch ``kvcacheio``
reference ops, the CPU stream/event module, gloo ranks, the reference sparse MLA.
Nothing here is used on a GPU deployment, and product code never imports it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from sglang_cp_hicache.core.releases import line_package
from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE, CpuDeviceModule


def line_runtime() -> ModuleType:
    """The CPU runtime module of the installed SGLang release's line."""
    line = line_package().rsplit(".", 1)[1]
    return importlib.import_module(f"sglang_cp_hicache.testing.{line}.runtime")


def install() -> Any:
    """Install what this process is missing of the installed line's CPU runtime, once."""
    return line_runtime().install()


def warm_import() -> None:
    """Import the installed line's cache stack (after :func:`install`)."""
    line_runtime().warm_import()


def device_module() -> CpuDeviceModule:
    """The CPU device module the cache controllers use after :func:`install`."""
    return CPU_DEVICE_MODULE


__all__ = ["device_module", "install", "line_runtime", "warm_import"]
