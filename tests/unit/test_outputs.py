"""Per-request latency figures derived from the recorded timestamps."""

from __future__ import annotations

import pytest

from tandem.outputs import RequestMetrics


def test_latency_figures_from_timestamps():
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        finished_time=12.6,
        token_times=[11.0, 11.2, 11.6, 12.6],
    )
    assert metrics.queue_time == pytest.approx(0.5)
    assert metrics.ttft == pytest.approx(1.0)
    assert metrics.prefill_time == pytest.approx(0.5)
    assert metrics.inter_token_latencies == pytest.approx([0.2, 0.4, 1.0])
    assert metrics.decode_time == pytest.approx(1.6)
    assert metrics.tpot == pytest.approx(1.6 / 3)
    assert metrics.e2e_latency == pytest.approx(2.6)


def test_unfinished_request_has_no_figures_yet():
    metrics = RequestMetrics(arrival_time=1.0, token_times=[2.0])
    assert metrics.queue_time is None and metrics.ttft is None and metrics.e2e_latency is None
    assert metrics.decode_time is None and metrics.tpot is None
    assert metrics.inter_token_latencies == []
