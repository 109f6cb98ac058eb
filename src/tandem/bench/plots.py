"""PNG figures of runs (matplotlib, Agg), all drawn from the request records:

- itl_timeline: each stream's inter-token gaps over the run, long-prompt arrivals marked;
- latency_cdfs: CDFs of TTFT and ITL, several runs overlaid;
- sweep_plot: output throughput against p99 ITL across a sweep (request rates, token budgets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from tandem.bench.report import compute_metrics, latencies

MAX_TIMELINE_STREAMS = 12
# Log axes labelled 20, 50, 100, 200 ms rather than 2x10^1.
PLAIN = FuncFormatter(lambda value, _: f"{value:g}")
PLAIN_MINOR = FuncFormatter(lambda value, _: f"{value:g}" if str(f"{value:g}")[0] in "25" else "")


def save_figure(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def itl_timeline(run: dict, path: str | Path, title: str | None = None) -> Path:
    """Gap before each token (ms) against when it arrived (s), one line per stream (requests
    tagged "stream", else every completed request, at most a dozen); each long prompt's send is
    a dashed line and the time until its first token a shaded band."""
    records = [r for r in run["records"] if r.ok and len(r.chunks) > 1]
    streams = [r for r in records if r.tag == "stream"] or records
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for number, record in enumerate(streams[:MAX_TIMELINE_STREAMS]):
        gaps = [gap * 1e3 for gap in latencies(record).itls]
        ax.plot(record.chunks[1:], gaps, lw=1, marker=".", ms=3, label=f"stream {number + 1}")
    longs = [r for r in run["records"] if r.tag == "long"]
    for number, record in enumerate(longs):
        first = dict(label="long prompt sent") if number == 0 else {}
        ax.axvline(record.send, color="black", ls="--", lw=1, **first)
        if record.chunks:
            band = dict(label="long prompt waiting for its first token") if number == 0 else {}
            ax.axvspan(record.send, record.chunks[0], color="grey", alpha=0.15, **band)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or f"Inter-token latency per stream: {run.get('label', '')}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no data hidden
    return save_figure(fig, path)


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    fractions = [0.0] + [(i + 1) / len(ordered) for i in range(len(ordered))]
    ax.step([ordered[0], *ordered], fractions, where="post", label=f"{label} (n={len(ordered)})")


def latency_cdfs(runs: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """Cumulative distributions of TTFT and ITL (log-scale ms), one line per run."""
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for run in runs:
        lats = [latencies(r) for r in run["records"] if r.ok]
        label = run.get("label", "run")
        _cdf(ttft_ax, [lat.ttft * 1e3 for lat in lats], label)
        _cdf(itl_ax, [gap * 1e3 for lat in lats for gap in lat.itls], label)
    for ax, name in ((ttft_ax, "time to first token"), (itl_ax, "inter-token latency")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN)
        ax.xaxis.set_minor_formatter(PLAIN_MINOR)
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("requests" if ax is ttft_ax else "token gaps"))
        ax.set_ylim(0, 1.02)
        ax.set_title(f"CDF of {name}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def sweep_plot(
    series: dict[str, Sequence[tuple[str, dict]]],
    path: str | Path,
    title: str = "Throughput against tail inter-token latency",
) -> Path:
    """Output tok/s (y) against p99 ITL (x), one line per series, each point labelled with its
    sweep value; `series` maps a name to [(point label, run)]."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in series.items():
        xs, ys = [], []
        for label, run in points:
            metrics = compute_metrics(run["records"])
            x, y = metrics["itl_ms"]["p99"], metrics["output_throughput"]
            if math.isnan(x) or math.isnan(y):
                continue
            xs.append(x)
            ys.append(y)
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
