"""What `LLM.get_metrics()` returns: the engine's Prometheus metrics as plain objects, in the
shapes of vLLM's `vllm.v1.metrics.reader` (Counter, Gauge, Histogram, Vector with a name and
labels). The metrics are the server's (`tandem:` + vLLM's name for the same meaning; every one
is described in docs/metrics.md), kept for the offline engine in a private registry."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PREFIX = "tandem:"


@dataclass
class Metric:
    """A metric's name and labels; one metric may appear once per label set."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer count."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM uses it for per-position speculative
    acceptance; tandem has no such metric yet, so get_metrics returns none)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: bucket upper bound (as Prometheus writes it, "+Inf" included)
    -> cumulative count of observations <= it. `count` equals the "+Inf" bucket."""

    count: int
    sum: float
    buckets: dict[str, int]


def snapshot(registry: Any, prefix: str = PREFIX) -> list[Metric]:
    """Every counter, gauge and histogram in a prometheus_client registry whose name starts
    with `prefix`, one object per label set (other metric types are skipped)."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, s.labels, s.value) for s in _samples(family, "")]
        elif family.type == "counter":
            samples = _samples(family, "_total")
            collected += [Counter(family.name, s.labels, int(s.value)) for s in samples]
        elif family.type == "histogram":
            collected += _histograms(family)
    return collected


def _samples(family: Any, suffix: str) -> list[Any]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _label_key(labels: dict[str, str], drop: str | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def _histograms(family: Any) -> Iterable[Histogram]:
    buckets: dict[tuple, dict[str, int]] = {}
    for sample in _samples(family, "_bucket"):
        key = _label_key(sample.labels, drop="le")
        buckets.setdefault(key, {})[sample.labels["le"]] = int(sample.value)
    counts = {_label_key(s.labels): int(s.value) for s in _samples(family, "_count")}
    sums = {_label_key(s.labels): float(s.value) for s in _samples(family, "_sum")}
    for key, by_bound in buckets.items():
        yield Histogram(family.name, dict(key), counts.get(key, 0), sums.get(key, 0.0), by_bound)
