"""The installed SGLang's launch defaults, read from its own argument parser: what a user
gets for a flag left off the ``sglang.launch_server`` command line."""

from __future__ import annotations

import argparse
from typing import Any


def upstream_default(dest: str) -> Any:
    """``ServerArgs``' command-line default for ``dest`` (e.g. ``"hicache_mem_layout"``)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.get_default(dest)
