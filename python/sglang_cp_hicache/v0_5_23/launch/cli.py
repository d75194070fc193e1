"""``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23's command line.

* ``ServerArgs.add_cli_args`` (AFTER) adds the option and 0.5.12's two spellings
  (``legacy_spellings``); parsing the option proves the plugin's hooks are in place
  (:data:`_EnableAction`).
* ``ServerArgs.from_cli_args`` (AROUND) copies the parsed value onto the record, which
  upstream's ``from_cli_args`` would drop (it copies record fields only).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.v0_5_23.launch.flag import (
    CLI_FLAG,
    FLAG,
    set_cp_shared_kv_enabled,
    verify_plugin_installed,
)
from sglang_cp_hicache.v0_5_23.launch.legacy_spellings import (
    LEGACY_CP_DEST,
    LEGACY_CP_FLAG,
    LEGACY_CP_STRATEGIES,
    LEGACY_MODE_DEST,
    LEGACY_MODE_FLAG,
    translate_legacy_spellings,
)

_EnableAction = hook_table.verified_flag_action(verify_plugin_installed)


def add_cli_args_after(result: Any, parser: argparse.ArgumentParser) -> None:
    if any(CLI_FLAG in action.option_strings for action in parser._actions):
        return None
    parser.add_argument(
        CLI_FLAG,
        dest=FLAG,
        action=_EnableAction,
        help=(
            "DSA prefill context parallel with shared KV: each prefill-CP rank stores only "
            "the KV pages it owns (owner = logical page %% cp_size), multiplying KV "
            "capacity by cp_size; HiCache backs up and loads only owned pages. Turns on "
            "--enable-kv-cache-sharding. Requires --enable-prefill-cp --cp-strategy "
            "interleave on a PD prefill worker. (sglang-cp-hicache plugin)"
        ),
    )
    parser.add_argument(
        LEGACY_CP_FLAG,
        dest=LEGACY_CP_DEST,
        action="store_true",
        default=None,  # None: not given (a given flag is a deprecation to report)
        help=(
            "Deprecated 0.5.12 spelling of --enable-prefill-cp --cp-strategy interleave, "
            f"accepted only with {CLI_FLAG}. (sglang-cp-hicache plugin)"
        ),
    )
    parser.add_argument(
        LEGACY_MODE_FLAG,
        dest=LEGACY_MODE_DEST,
        choices=tuple(LEGACY_CP_STRATEGIES),
        default=None,
        help=(
            "Deprecated 0.5.12 spelling of --cp-strategy (round-robin-split: interleave, "
            f"in-seq-split: zigzag), accepted only with {CLI_FLAG}. (sglang-cp-hicache plugin)"
        ),
    )
    return None


def from_cli_args_around(original: Callable, cls: type, args: argparse.Namespace):
    enabled = getattr(args, FLAG, False) is True
    translate_legacy_spellings(vars(args), cp_shared_kv=enabled)
    record = original(cls, args)
    if enabled:  # flag off: the record is exactly upstream's
        set_cp_shared_kv_enabled(record, True)
    return record


__all__ = ["add_cli_args_after", "from_cli_args_around"]
