"""``--plot``: hit rate and host bytes per rank over the run (matplotlib, optional)."""

from __future__ import annotations

from sglang_cp_hicache.sim.report.records import SimReport

MATPLOTLIB_HINT = (
    "--plot needs matplotlib, which is not installed in this environment; "
    "install it (pip install matplotlib==3.11.2) or drop --plot"
)


class PlotUnavailable(RuntimeError):
    pass


def require_matplotlib() -> None:
    """Fail before a run rather than after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(MATPLOTLIB_HINT) from None


# One line style per column: plugin vs native vs upstream at a glance.
_STYLES = {"plugin": "-", "native": "--", "upstream": ":"}


def write_plot(report: SimReport, path: str) -> None:
    """Two panels against requests: every column's cumulative hit rate, and every column's
    physical host bytes per rank (the mean over its ranks, with the band from the lightest
    to the heaviest rank) beside the logical (replicated) host bytes."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series = report.series
    fig, (hits, host) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, column) in enumerate(series["columns"].items()):
        style, colour = _STYLES.get(name, "-"), colours[index % len(colours)]
        x = column["requests"]
        hits.plot(x, column["hit_rate"], style, color=colour, label=column["label"], linewidth=2)
        per_rank = [[v / 2**20 for v in values] for values in column["host_physical_bytes_per_rank"]]
        low, high = [min(at) for at in zip(*per_rank)], [max(at) for at in zip(*per_rank)]
        mean = [sum(at) / len(at) for at in zip(*per_rank)]
        ranks = len(per_rank)
        label = column["label"] + (f" (mean, band: min-max of {ranks} ranks)" if ranks > 1 else "")
        host.plot(x, mean, style, color=colour, linewidth=2, label=label)
        if ranks > 1:
            host.fill_between(x, low, high, color=colour, alpha=0.15, linewidth=0)
    hits.set_ylabel("cumulative hit rate")
    hits.set_title(f"SGLang {report.sglang_release}, cp={report.config['cp_size']}")
    hits.legend()
    logical = [v / 2**20 for v in series["host_logical_bytes"]]
    host.plot(series["requests"], logical, "k-", alpha=0.4, linewidth=3, label="logical (replicated)")
    host.set_ylabel("host KV per rank, physical (MiB)")
    host.set_xlabel("requests")
    host.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
