"""0.5.12's prefill-CP spellings under ``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23.

0.5.23 renamed prefill CP to ``--enable-prefill-cp --cp-strategy {interleave,zigzag}`` and
removed ``--enable-nsa-prefill-context-parallel`` and ``--nsa-prefill-cp-mode
{round-robin-split,in-seq-split}`` without an alias. With the plugin's flag they are accepted
as deprecated aliases (round-robin-split -> interleave, in-seq-split -> zigzag, 0.5.12's
default round-robin-split), with one warning per spelling: that is how SGLang itself retires
a flag (``--enable-dp-attention``, ``--disable-cuda-graph`` map to their new spelling with a
warning, ``server_args.py:add_cli_args``), and it lets the mission's launch command, which
is spelled for 0.5.12, run on both lines. Without the plugin's flag they are refused with a
message naming the 0.5.23 spellings: with its flag off the plugin widens nothing SGLang
accepts.
"""

from __future__ import annotations

import logging
from typing import Any, MutableMapping, Set

from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError

logger = logging.getLogger(__name__)

LEGACY_CP_DEST = "enable_nsa_prefill_context_parallel"
LEGACY_CP_FLAG = "--enable-nsa-prefill-context-parallel"
LEGACY_MODE_DEST = "nsa_prefill_cp_mode"
LEGACY_MODE_FLAG = "--nsa-prefill-cp-mode"
#: 0.5.12's prefill-CP modes and the 0.5.23 ``--cp-strategy`` of each (``layers/cp/base.py``).
LEGACY_CP_STRATEGIES = {"round-robin-split": "interleave", "in-seq-split": "zigzag"}
LEGACY_DEFAULT_MODE = "round-robin-split"  # 0.5.12's default --nsa-prefill-cp-mode

_warned_spellings: Set[str] = set()


def _warn_once(spelling: str, meaning: str) -> None:
    if spelling not in _warned_spellings:
        _warned_spellings.add(spelling)
        logger.warning(
            "%s is the SGLang 0.5.12 spelling; on SGLang 0.5.23 it means %s. Use the new "
            "spelling: the old one is accepted only with %s.",
            spelling,
            meaning,
            CLI_FLAG,
        )


def translate_legacy_spellings(values: MutableMapping[str, Any], *, cp_shared_kv: bool) -> None:
    """Rewrite 0.5.12's prefill-CP spellings in ``values`` (an argparse namespace's dict or
    Engine keywords) into 0.5.23's record fields, in place; refuse them without the flag.

    An explicit 0.5.23 ``cp_strategy`` wins over the old default; one that contradicts an
    explicit old mode is refused.
    """
    legacy_cp = values.pop(LEGACY_CP_DEST, None)
    legacy_mode = values.pop(LEGACY_MODE_DEST, None)
    if not legacy_cp and legacy_mode is None:
        return
    given = [LEGACY_CP_FLAG] if legacy_cp else []
    given += [f"{LEGACY_MODE_FLAG} {legacy_mode}"] if legacy_mode is not None else []
    if not cp_shared_kv:
        raise CpSharedKVConfigError(
            f"{' '.join(given)}: SGLang 0.5.23 removed these 0.5.12 spellings; write "
            "--enable-prefill-cp --cp-strategy interleave (round-robin-split) or "
            f"--cp-strategy zigzag (in-seq-split). The plugin accepts the old spelling only "
            f"together with {CLI_FLAG}."
        )
    if legacy_mode is not None and legacy_mode not in LEGACY_CP_STRATEGIES:
        raise CpSharedKVConfigError(
            f"{LEGACY_MODE_FLAG} {legacy_mode!r}: choose from {', '.join(LEGACY_CP_STRATEGIES)}"
        )
    strategy = LEGACY_CP_STRATEGIES[legacy_mode or LEGACY_DEFAULT_MODE]
    explicit = values.get("cp_strategy")
    if explicit is not None and legacy_mode is not None and explicit != strategy:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: {LEGACY_MODE_FLAG} {legacy_mode} means --cp-strategy {strategy}, "
            f"which contradicts --cp-strategy {explicit}; give one of them"
        )
    if legacy_cp:
        values["enable_prefill_cp"] = True
        implied = f" --cp-strategy {strategy}" if explicit is None and legacy_mode is None else ""
        _warn_once(LEGACY_CP_FLAG, f"--enable-prefill-cp{implied}")
    if explicit is None:
        values["cp_strategy"] = strategy
    if legacy_mode is not None:
        _warn_once(f"{LEGACY_MODE_FLAG} {legacy_mode}", f"--cp-strategy {strategy}")


__all__ = [
    "LEGACY_CP_DEST",
    "LEGACY_CP_FLAG",
    "LEGACY_CP_STRATEGIES",
    "LEGACY_DEFAULT_MODE",
    "LEGACY_MODE_DEST",
    "LEGACY_MODE_FLAG",
    "translate_legacy_spellings",
]
