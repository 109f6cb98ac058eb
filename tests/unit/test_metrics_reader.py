"""get_metrics' reader: a Prometheus registry as vLLM-shaped Counter / Gauge / Histogram."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Summary
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram

from tandem.metrics_reader import Counter, Gauge, Histogram, snapshot


def test_snapshot_reads_each_type_per_label_set():
    registry = CollectorRegistry()
    tokens = PromCounter("tandem:tokens", "t", ["model_name", "kind"], registry=registry)
    tokens.labels("m", "prompt").inc(5)
    tokens.labels("m", "generation").inc(3)
    PromGauge("tandem:running", "r", ["model_name"], registry=registry).labels("m").set(2)
    ttft = PromHistogram("tandem:ttft", "h", ["model_name"], buckets=(0.1, 1.0), registry=registry)
    for seconds in (0.05, 0.5, 5.0):
        ttft.labels("m").observe(seconds)
    Summary("tandem:skipped", "s", registry=registry).observe(1)
    PromGauge("other:gauge", "not ours", registry=registry).set(1)

    metrics = {(m.name, tuple(sorted(m.labels.items()))): m for m in snapshot(registry)}
    assert metrics[("tandem:tokens", (("kind", "prompt"), ("model_name", "m")))] == Counter(
        "tandem:tokens", {"model_name": "m", "kind": "prompt"}, 5
    )
    assert metrics[("tandem:running", (("model_name", "m"),))] == Gauge(
        "tandem:running", {"model_name": "m"}, 2.0
    )
    histogram = metrics[("tandem:ttft", (("model_name", "m"),))]
    assert isinstance(histogram, Histogram)
    assert histogram.count == 3 and histogram.sum == pytest.approx(5.55)
    assert histogram.buckets == {"0.1": 1, "1.0": 2, "+Inf": 3}
    assert {m.name for m in metrics.values()} == {"tandem:tokens", "tandem:running", "tandem:ttft"}
