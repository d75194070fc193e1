"""Which SGLang releases the plugin supports, and which line's package serves each.

Read from the installed distribution's metadata, so choosing a line imports no SGLang.
"""

from __future__ import annotations

from importlib import metadata
from typing import Dict, Optional

#: Supported SGLang releases, newest first, and the subpackage of each line.
LINES: Dict[str, str] = {
    "0.5.23": "v0_5_23",
    "0.5.12.post1": "v0_5_12",
}


class UnsupportedSGLangRelease(RuntimeError):
    """The installed SGLang is not one of :data:`LINES`."""


def installed_release() -> str:
    """The version of the installed ``sglang`` distribution (raises when none is installed)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError as error:
        raise UnsupportedSGLangRelease(
            f"sglang-cp-hicache: no sglang is installed; supported releases: {_supported()}"
        ) from error


def line_package(release: Optional[str] = None) -> str:
    """``sglang_cp_hicache.<line>`` for ``release`` (default: the installed one).

    Raises :class:`UnsupportedSGLangRelease` naming the supported releases for any other
    version: every hook targets one release's internals, so a near miss is still a refusal.
    """
    release = installed_release() if release is None else release
    line = LINES.get(release)
    if line is None:
        raise UnsupportedSGLangRelease(
            f"sglang-cp-hicache does not support sglang=={release}; supported releases: "
            f"{_supported()} (pip install 'sglang-cp-hicache[sglang-0-5-23]' pins the newest)"
        )
    return f"sglang_cp_hicache.{line}"


def _supported() -> str:
    return ", ".join(f"sglang=={release}" for release in LINES)
