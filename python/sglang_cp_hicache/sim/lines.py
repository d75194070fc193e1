"""The installed SGLang line's simulator: its rank entry points and what it can run.

Each line's driver package (``sim/v0_5_12``, ``sim/v0_5_23``) exposes one :class:`LineSim`
as ``sim.<line>.rank.LINE``. The engine picks it from the installed release
(``core.releases.line_package``) and never imports the other line; choosing imports no
SGLang (the entry points import it inside the rank processes).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, List, Optional, Tuple

from sglang_cp_hicache.core.releases import installed_release, line_package
from sglang_cp_hicache.sim.config import SimConfig

#: Column names, in table order. ``plugin`` and ``native`` run on ``cp_size`` ranks;
#: ``upstream`` is SGLang's unsharded cache on one rank with the same per-rank memory;
#: ``upstream_logical`` the same with cp x the per-rank pools (SimConfig.storage_logical_baseline).
COLUMNS = ("plugin", "native", "upstream", "upstream_logical")


@dataclass(frozen=True)
class Column:
    """One replay of the trace: an implementation on ``world_size`` ranks."""

    name: str  # one of COLUMNS
    label: str  # table header
    world_size: int
    entry: Callable  # module-level ``fn(ctx, cfg, steps, *args)``: run_ranks imports it by name
    args: tuple = ()


@dataclass(frozen=True)
class LineSim:
    """What one SGLang line's simulator runs.

    ``sharded_main(ctx, cfg, steps, shard_impl)`` is one sharded rank (``shard_impl`` one of
    ``config.SHARD_IMPLS``); ``upstream_main(ctx, cfg, steps)`` the cp-1 unsharded replay.
    """

    release: str  # the SGLang release this line targets
    native_sharding: bool  # upstream ships KV sharding (--enable-kv-cache-sharding)
    per_layer_backup: Optional[bool]  # the line's default; None: not on this line
    sharded_main: Callable
    upstream_main: Callable
    mem_layout: str  # the line's HiCache host layout when unset: upstream's default
    # HiCache L3 backends the line attaches (SimConfig.storage_backend), and its run-scoped
    # set-up ``open_storage(cfg)``: a context manager yielding what the columns' ranks get
    # (folders, a local store), or None without storage. Empty: storage is refused.
    storage_backends: Tuple[str, ...] = ()
    open_storage: Optional[Callable[[SimConfig], ContextManager[Any]]] = None
    # The planted faults (``config.FAULTS`` keys) this line's replay plants; any other is
    # refused rather than run as a clean replay that cannot fail.
    faults: Tuple[str, ...] = ()

    def check(self, cfg: SimConfig) -> None:
        """Refuse what this line cannot run, with one message (ValueError)."""
        if cfg.fault is not None and cfg.fault not in self.faults:
            raise ValueError(
                f"fault {cfg.fault!r} is not planted on the SGLang {self.release} line "
                f"(it plants {', '.join(self.faults) or 'none'})"
            )
        if cfg.storage_backend is not None and cfg.storage_backend not in self.storage_backends:
            raise ValueError(
                f"storage_backend={cfg.storage_backend!r}: the SGLang {self.release} line runs no "
                "HiCache L3 storage under CP shared KV (its flag refuses "
                "--hicache-storage-backend); use the 0.5.23 line"
            )
        if cfg.shard_impl == "native" and not self.native_sharding:
            raise ValueError(
                f"shard_impl='native': SGLang {self.release} has no native KV sharding "
                "(upstream ships it from 0.5.23 as --enable-kv-cache-sharding)"
            )
        if cfg.per_layer_backup and self.per_layer_backup is None:
            raise ValueError(
                f"per_layer_backup=True: the {self.release} line has no per-layer D2H backup "
                "(upstream backs up all layers at once); leave it unset or pass False"
            )

    def resolved_per_layer_backup(self, cfg: SimConfig) -> bool:
        """``cfg.per_layer_backup``, or the line's default when unset."""
        if cfg.per_layer_backup is not None:
            return cfg.per_layer_backup
        return bool(self.per_layer_backup)

    def resolved_mem_layout(self, cfg: SimConfig) -> str:
        """``cfg.mem_layout``, or the line's default when unset."""
        return cfg.mem_layout or self.mem_layout

    def storage(self, cfg: SimConfig) -> ContextManager[Any]:
        """The run's L3 set-up (yields None without ``cfg.storage_backend``)."""
        if cfg.storage_backend is None or self.open_storage is None:
            return contextlib.nullcontext(None)
        return self.open_storage(cfg)

    def columns(self, cfg: SimConfig, storage: Any = None) -> List[Column]:
        """The replays ``cfg`` asks for on this line, main column first; with ``storage``
        (what :meth:`storage` yielded) the entries get it as their last argument."""
        extra = () if storage is None else (storage,)
        main = Column(
            cfg.shard_impl,
            f"cp={cfg.cp_size} {cfg.shard_impl}",
            cfg.cp_size,
            self.sharded_main,
            (cfg.shard_impl, *extra),
        )
        columns = [main]
        if cfg.runs_native_column() and self.native_sharding:
            columns.append(
                Column("native", f"cp={cfg.cp_size} native", cfg.cp_size, self.sharded_main, ("native",))
            )
        if cfg.baseline:
            columns.append(Column("upstream", "cp=1 upstream", 1, self.upstream_main, extra))
        if cfg.storage_logical_baseline:  # needs storage (SimConfig refuses it without)
            label = f"cp=1 upstream x{cfg.cp_size}"
            args = (storage, "upstream_logical")
            columns.append(Column("upstream_logical", label, 1, self.upstream_main, args))
        return columns


def installed_line() -> LineSim:
    """The simulator of the installed SGLang release's line (raises for any other release)."""
    line = line_package().rsplit(".", 1)[1]
    return importlib.import_module(f"sglang_cp_hicache.sim.{line}.rank").LINE


def installed_line_description() -> str:
    """One line for ``--help``: which SGLang release runs, or why none can."""
    try:
        release = installed_release()
        line_package(release)
    except RuntimeError as error:
        return f"no supported SGLang here ({error})"
    return f"SGLang {release} (its line: sglang_cp_hicache.{line_package(release).rsplit('.', 1)[1]})"
