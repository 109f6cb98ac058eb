"""Every figure of a run, derived from its request records (nothing is measured twice), with
vLLM's definitions (`vllm bench serve`):

- TTFT: first output chunk's arrival - send.
- E2E latency: last output chunk's arrival - send.
- ITL: every gap between consecutive output chunks of a request (all requests' gaps pooled).
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- duration: last response's end - first send; throughputs divide by it: completed requests,
  output tokens, input + output tokens per second.
- goodput: completed requests per second whose every SLO holds (`ttft`, `tpot`, `e2el`, in ms;
  a one-token request's TPOT counts as 0).
- percentiles: linear interpolation between closest ranks (numpy's default).

Failed requests count in `failed` (and in the duration) and in no latency figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.records import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2el")
STAT_KEYS = ("mean", "median", "p90", "p99", "max")
LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


@dataclass
class Latencies:
    """One completed request's figures, in seconds."""

    ttft: float
    e2el: float
    itls: list[float]
    tpot: float | None  # None with a single output token


def latencies(record: RequestRecord) -> Latencies:
    ttft = record.chunks[0] - record.send
    e2el = record.chunks[-1] - record.send
    itls = [b - a for a, b in itertools.pairwise(record.chunks)]
    tokens = record.num_output_tokens
    tpot = (e2el - ttft) / (tokens - 1) if tokens > 1 else None
    return Latencies(ttft, e2el, itls, tpot)


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linearly interpolated between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p90, p99 and max of seconds, in milliseconds (NaN when empty)."""
    if not values:
        return dict.fromkeys(STAT_KEYS, math.nan)
    return {
        "mean": sum(values) / len(values) * 1e3,
        "median": percentile(values, 50) * 1e3,
        "p90": percentile(values, 90) * 1e3,
        "p99": percentile(values, 99) * 1e3,
        "max": max(values) * 1e3,
    }


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise argparse.ArgumentTypeError(f"goodput SLO {item!r}: the key is one of {SLO_KEYS}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"goodput SLO {item!r}: need KEY:MILLISECONDS"
            ) from None
    return slos


def meets(lat: Latencies, slos: dict[str, float]) -> bool:
    values = {"ttft": lat.ttft, "tpot": lat.tpot or 0.0, "e2el": lat.e2el}
    return all(values[key] * 1e3 <= limit for key, limit in slos.items())


def compute_metrics(records: Sequence[RequestRecord], slos: dict[str, float] | None = None) -> dict:
    done = [r for r in records if r.ok]
    lats = [latencies(r) for r in done]
    sent = [r for r in records if not math.isnan(r.send)]
    duration = max(r.end for r in sent) - min(r.send for r in sent) if sent else math.nan
    input_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in done
    )
    output_tokens = sum(r.num_output_tokens for r in done)

    def rate(count: float) -> float:
        return count / duration if duration and duration > 0 else math.nan

    metrics: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "short": sum(r.num_output_tokens < r.output_len for r in done),
        "duration_s": duration,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "goodput": rate(sum(meets(lat, slos) for lat in lats)) if slos else None,
        "slos_ms": dict(slos or {}),
        "ttft_ms": stats_ms([lat.ttft for lat in lats]),
        "tpot_ms": stats_ms([lat.tpot for lat in lats if lat.tpot is not None]),
        "itl_ms": stats_ms([gap for lat in lats for gap in lat.itls]),
        "e2el_ms": stats_ms([lat.e2el for lat in lats]),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
    return metrics


# -- runs on disk -------------------------------------------------------------------------------


def load_run(path: str | Path) -> dict:
    run = json.loads(Path(path).read_text())
    run["records"] = [RequestRecord.from_dict(r) for r in run["records"]]
    run.setdefault("label", Path(path).stem)
    return run


def save_run(run: dict, path: str | Path) -> None:
    data = dict(run)
    data["records"] = [r.to_dict() for r in run["records"]]
    if isinstance(data.get("warmup"), RequestRecord):
        data["warmup"] = data["warmup"].to_dict()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(data), indent=1) + "\n")


def _finite(value: Any) -> Any:
    """NaN as null: JSON has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# -- text ---------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_summary(metrics: dict, title: str = "tandem bench serve") -> str:
    lines = [f"{f' {title} ':=^60}"]

    def row(name: str, value: Any, digits: int = 2) -> None:
        lines.append(f"{name:<42}{_num(value, digits):>18}")

    row("Completed requests", metrics["completed"])
    row("Failed requests", metrics["failed"])
    if metrics["short"]:
        row("Completed short of their output length", metrics["short"])
    row("Duration (s)", metrics["duration_s"])
    row("Input tokens", metrics["input_tokens"])
    row("Output tokens", metrics["output_tokens"])
    row("Request throughput (req/s)", metrics["request_throughput"])
    row("Output token throughput (tok/s)", metrics["output_throughput"])
    row("Total token throughput (tok/s)", metrics["total_token_throughput"])
    if metrics["goodput"] is not None:
        slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in metrics["slos_ms"].items())
        row(f"Goodput (req/s; {slos})", metrics["goodput"])
    for key in LATENCY_KEYS:
        lines.append(f"{f' {LATENCY_NAMES[key]} (ms) ':-^60}")
        for stat, value in metrics[f"{key}_ms"].items():
            row(f"{stat}", value)
    for error in metrics["errors"]:
        lines.append(f"error: {error[:200]}")
    lines.append("=" * 60)
    return "\n".join(lines)


COMPARE_ROWS: list[tuple[str, str, str | None, int]] = [
    ("completed", "completed", None, 0),
    ("failed", "failed", None, 0),
    ("duration (s)", "duration_s", None, 1),
    ("requests/s", "request_throughput", None, 2),
    ("output tok/s", "output_throughput", None, 1),
    ("total tok/s", "total_token_throughput", None, 1),
    ("goodput (req/s)", "goodput", None, 2),
] + [
    (f"{LATENCY_NAMES[key]} {stat} (ms)", f"{key}_ms", stat, 0 if key in ("ttft", "e2el") else 1)
    for key in LATENCY_KEYS
    for stat in STAT_KEYS
]


def compare_table(runs: Sequence[dict], slos: dict[str, float] | None = None) -> str:
    """A Markdown table, one column per run, every figure recomputed from the records."""
    metrics = [
        compute_metrics(run["records"], slos or run.get("config", {}).get("goodput"))
        for run in runs
    ]
    header = "| metric | " + " | ".join(run["label"] for run in runs) + " |"
    lines = [header, "|---|" + "---:|" * len(runs)]
    for name, key, stat, digits in COMPARE_ROWS:
        values = [m[key] if stat is None else m[key][stat] for m in metrics]
        if key == "goodput" and all(v is None for v in values):
            continue
        lines.append(f"| {name} | " + " | ".join(_num(v, digits) for v in values) + " |")
    return "\n".join(lines)


RUN_COLUMNS: list[tuple[str, str, str | None, int]] = [
    ("req/s", "request_throughput", None, 2),
    ("out tok/s", "output_throughput", None, 1),
    ("TTFT p50", "ttft_ms", "median", 0),
    ("TTFT p99", "ttft_ms", "p99", 0),
    ("TPOT p50", "tpot_ms", "median", 1),
    ("ITL p50", "itl_ms", "median", 1),
    ("ITL p99", "itl_ms", "p99", 1),
    ("ITL max", "itl_ms", "max", 0),
    ("E2E p50", "e2el_ms", "median", 0),
]


def runs_table(runs: Sequence[dict], slos: dict[str, float] | None = None) -> str:
    """A Markdown table, one row per run (latencies in ms): the compact view of many runs."""
    metrics = [compute_metrics(run["records"], slos) for run in runs]
    good = slos is not None and bool(slos)
    header = ["run", "ok/failed", *(name for name, *_ in RUN_COLUMNS)] + (
        ["goodput"] if good else []
    )
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for run, m in zip(runs, metrics, strict=True):
        cells = [run["label"], f"{m['completed']}/{m['failed']}"]
        cells += [
            _num(m[key] if stat is None else m[key][stat], digits)
            for _, key, stat, digits in RUN_COLUMNS
        ]
        if good:
            cells.append(_num(m["goodput"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
