"""PNG figures of an engine's step log (`--step-log`, one JSON object per step):

- roofline: every step by arithmetic intensity (FLOPs per byte) against achieved FLOP/s, under
  the machine's two ceilings (bandwidth slope, compute flat), coloured by phase mix;
- timeline: each step's prefill and decode tokens, and its time, over the run.

    tandem plot steps STEP_LOG --out DIR
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tandem.bench.plots import PLAIN, save_figure

PHASE_COLOURS = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple"}


def load_steps(path: str | Path) -> list[dict]:
    steps = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not steps:
        raise ValueError(f"{path} has no steps: run the engine with --step-log {path} first")
    return steps


def machine_ceilings(steps: list[dict]) -> tuple[float, float]:
    """Peak FLOP/s and bytes/s, recovered from the steps (mfu = achieved / peak)."""
    for step in steps:
        if step["mfu"] > 0 and step["mbu"] > 0 and step["step_time"] > 0:
            seconds = step["step_time"]
            return step["flops"] / seconds / step["mfu"], step["bytes"] / seconds / step["mbu"]
    raise ValueError("no step in the log has a measured time and utilization")


def roofline(steps: list[dict], path: str | Path, title: str | None = None) -> Path:
    peak_flops, peak_bytes = machine_ceilings(steps)
    intensity = np.array([s["flops"] / s["bytes"] for s in steps])
    achieved = np.array([s["flops"] / s["step_time"] for s in steps])
    fig, ax = plt.subplots(figsize=(8, 5.5))
    low = min(intensity.min(), peak_flops / peak_bytes) / 3
    high = max(intensity.max(), peak_flops / peak_bytes) * 3
    x = np.geomspace(low, high, 200)
    ceilings = f"ceilings: {peak_flops / 1e12:.2f} TFLOP/s, {peak_bytes / 1e9:.0f} GB/s"
    ax.plot(x, np.minimum(peak_flops, x * peak_bytes), color="black", linewidth=2, label=ceilings)
    ax.axvline(peak_flops / peak_bytes, color="grey", linestyle=":", linewidth=1)
    phases = np.array([s["phase"] for s in steps])
    for phase, colour in PHASE_COLOURS.items():
        chosen = phases == phase
        if chosen.any():
            ax.scatter(intensity[chosen], achieved[chosen], s=10, alpha=0.6, color=colour,
                       label=f"{phase} steps ({int(chosen.sum())})")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(PLAIN)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(title or "Engine steps against the machine's roofline (dotted: ridge point)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    return save_figure(fig, path)


def timeline(steps: list[dict], path: str | Path, title: str | None = None) -> Path:
    start = steps[0]["time"] - steps[0]["step_time"]
    ends = np.array([s["time"] - start for s in steps])
    prefill = np.array([s["num_prefill_tokens"] for s in steps])
    decode = np.array([s["num_decode_tokens"] for s in steps])
    fig, (tokens_ax, time_ax) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    width = np.array([s["step_time"] for s in steps])
    tokens_ax.bar(ends - width, decode, width=width, align="edge", color="tab:blue",
                  label="decode tokens")  # fmt: skip
    tokens_ax.bar(ends - width, prefill, width=width, bottom=decode, align="edge",
                  color="tab:orange", label="prefill tokens")  # fmt: skip
    tokens_ax.set_ylabel("tokens in the step")
    tokens_ax.legend(loc="upper right", fontsize=9)
    tokens_ax.set_title(title or "Step composition and step time over the run")
    colours = [PHASE_COLOURS[s["phase"]] for s in steps]
    time_ax.scatter(ends, width * 1e3, s=8, c=colours)
    time_ax.set_ylabel("step time (ms)")
    time_ax.set_xlabel("time since the first step began (s)")
    for phase, colour in PHASE_COLOURS.items():
        time_ax.scatter([], [], color=colour, label=phase)
    time_ax.legend(loc="upper right", fontsize=9)
    for ax in (tokens_ax, time_ax):
        ax.grid(True, alpha=0.3)
    return save_figure(fig, path)


def plot_steps(step_log: str | Path, out_dir: str | Path) -> list[Path]:
    steps = load_steps(step_log)
    out = Path(out_dir)
    return [roofline(steps, out / "roofline.png"), timeline(steps, out / "steps_timeline.png")]
