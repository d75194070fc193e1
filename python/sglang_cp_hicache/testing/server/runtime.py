"""The CPU server runtime: what an SGLang server process needs to serve on a CPU-only box.

Test-only. The serving harness (:mod:`sglang_cp_hicache.testing.server.cluster`) applies it
to every SGLang server process it starts, and to no other process: it puts a folder holding
a ``sitecustomize`` module on the process's ``PYTHONPATH`` and sets
:data:`RUNTIME_ENV` in its environment, so the interpreter runs :func:`install_server_runtime`
before anything else, in the server's main process and in every process SGLang spawns from
it (schedulers, detokenizer). The installed plugin never imports this package.

Each line's steps live in ``testing/<line>/server_runtime.py`` (``steps()``): what is
replaced, named in a few words, in the order it is applied. :class:`ServerRuntime` applies
them and logs one line naming every step, ``CPU server runtime (sglang X, pid P): ...``, so
a log can never be mistaken for a GPU run's.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Tuple

logger = logging.getLogger("sglang_cp_hicache.cpu_server_runtime")

#: Set to "1" in a server process's environment to install the runtime there.
RUNTIME_ENV = "SGLANG_CP_HICACHE_CPU_SERVER_RUNTIME"

SITECUSTOMIZE = '''"""Written by sglang_cp_hicache's serving harness: installs its test-only CPU server
runtime in SGLang server processes it starts (never on a deployment)."""
import os

if os.environ.get("{env}") == "1":
    from sglang_cp_hicache.testing.server.runtime import install_server_runtime

    install_server_runtime()
'''.format(env=RUNTIME_ENV)


@dataclass(frozen=True)
class RuntimeStep:
    """One thing the CPU runtime replaces: its name (logged) and how it is applied."""

    name: str
    apply: Callable[[], None]


class ServerRuntime:
    """A line's steps, applied once per process in order, then named in one log line."""

    def __init__(self, release: str, steps: Sequence[RuntimeStep]):
        self.release = release
        self.steps: Tuple[RuntimeStep, ...] = tuple(steps)

    def install(self) -> None:
        for step in self.steps:
            try:
                step.apply()
            except Exception as error:
                raise RuntimeError(f"CPU server runtime: step {step.name!r} failed: {error!r}") from error
        _startup_logger().warning(
            "CPU server runtime (sglang %s, pid %d; a CPU run, not a GPU one): %s",
            self.release,
            os.getpid(),
            "; ".join(step.name for step in self.steps),
        )


def _startup_logger() -> logging.Logger:
    """The runtime's logger, writing to stderr before SGLang configures logging."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    return logger


def line_server_runtime() -> ServerRuntime:
    """The installed SGLang release's runtime (imports no SGLang)."""
    from sglang_cp_hicache.core.releases import installed_release, line_package

    line = line_package().rsplit(".", 1)[1]
    module = importlib.import_module(f"sglang_cp_hicache.testing.{line}.server_runtime")
    return ServerRuntime(installed_release(), module.steps())


_installed = False


def install_server_runtime() -> None:
    """Install the installed line's runtime in this process, once."""
    global _installed
    if not _installed:
        line_server_runtime().install()
        _installed = True


def write_site_folder(folder: Path) -> Path:
    """Write the ``sitecustomize`` that installs the runtime into ``folder``; return it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


__all__ = [
    "RUNTIME_ENV",
    "RuntimeStep",
    "ServerRuntime",
    "install_server_runtime",
    "line_server_runtime",
    "write_site_folder",
]
