"""Load one of the repository's scripts (``scripts/...``, not a package) as a module, for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def load_script(relative_path: str, module_name: str) -> ModuleType:
    """``ROOT / relative_path`` executed as module ``module_name`` (registered in
    ``sys.modules``, so dataclasses and pickling resolve its names)."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
