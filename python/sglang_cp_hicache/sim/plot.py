"""``--plot``: hit rate and host bytes per rank over the run (matplotlib, optional)."""

from __future__ import annotations

from sglang_cp_hicache.sim.report import SimReport

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


def write_plot(report: SimReport, path: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series = report.series
    fig, (hits, host) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    cp_label = f"cp={report.config['cp_size']} shared KV"
    hits.plot(series["requests"], series["hit_rate"], label=cp_label)
    if "baseline_hit_rate" in series:
        hits.plot(series["baseline_requests"], series["baseline_hit_rate"], label="cp=1 upstream")
    hits.set_ylabel("cumulative hit rate")
    hits.legend()
    for rank, values in enumerate(series["host_physical_bytes_per_rank"]):
        host.plot(series["requests"], [v / 2**20 for v in values], label=f"rank {rank} physical")
    logical = [v / 2**20 for v in series["host_logical_bytes"]]
    host.plot(series["requests"], logical, "k--", label="logical (replicated)")
    host.set_ylabel("host KV (MiB)")
    host.set_xlabel("requests")
    host.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
