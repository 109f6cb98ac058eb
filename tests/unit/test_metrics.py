"""The Prometheus stat logger: synthetic engine telemetry in, the rendered exposition checked;
the Grafana dashboard and docs/metrics.md name only metrics the logger exports."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tandem.engine.log_stats import LoggingStatLogger
from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StepStats
from tandem.outputs import RequestMetrics
from tandem.server.metrics import (
    STEP_TIME_BUCKETS,
    TTFT_BUCKETS,
    PrometheusStatLogger,
)

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "tandem-dashboard.json"
DOCS = ROOT / "docs" / "metrics.md"


# -- helpers -------------------------------------------------------------------------------


def samples(logger: PrometheusStatLogger) -> list:
    body, _ = logger.render()
    families = text_string_to_metric_families(body.decode())
    return [sample for family in families for sample in family.samples]


def value(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels are model_name=MODEL plus `labels`."""
    labels = {"model_name": logger.model_name, **labels}
    found = [s.value for s in samples(logger) if s.name == name and s.labels == labels]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def bucket(logger: PrometheusStatLogger, name: str, le: float) -> float:
    """The cumulative count of histogram `name` at upper bound `le`."""
    found = [
        s.value
        for s in samples(logger)
        if s.name == name + "_bucket" and math.isclose(float(s.labels["le"]), le)
    ]
    assert len(found) == 1, (name, le, found)
    return found[0]


def scheduler_stats(**overrides: float) -> SchedulerStats:
    fields: dict = dict(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        num_kv_blocks=100,
        num_free_kv_blocks=100,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_steps=0,
        num_requests_received=0,
    )
    fields.update(overrides)
    return SchedulerStats(**fields)


def step(prefill: int, decode: int, seconds: float, seqs: int = 1) -> StepStats:
    return StepStats(
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        num_seqs=seqs,
        num_preempted=0,
        step_time=seconds,
        kv_usage=0.5,
        num_waiting=0,
        num_running=seqs,
    )


def finished(
    metrics: RequestMetrics, reason: str = "stop", prompt: int = 7, generated: int | None = None
) -> FinishedRequestStats:
    return FinishedRequestStats(
        request_id="r0",
        finish_reason=reason,
        num_prompt_tokens=prompt,
        num_generation_tokens=len(metrics.token_times) if generated is None else generated,
        metrics=metrics,
    )


def completed_metrics() -> RequestMetrics:
    """Arrival 10.0, scheduled 10.5, tokens at 11.0, 11.018, 11.045, 11.09; finished 11.09."""
    return RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        finished_time=11.09,
        token_times=[11.0, 11.018, 11.045, 11.09],
    )


@pytest.fixture
def logger() -> PrometheusStatLogger:
    return PrometheusStatLogger(MODEL)


# -- scheduler state and cumulative counters -----------------------------------------------


def test_gauges_show_the_latest_scheduler_state(logger):
    logger.record_steps(scheduler_stats(num_running=3, num_waiting=5, kv_cache_usage=0.25), [])
    assert value(logger, "tandem:num_requests_running") == 3
    assert value(logger, "tandem:num_requests_waiting") == 5
    assert value(logger, "tandem:kv_cache_usage_perc") == pytest.approx(0.25)
    logger.record_steps(scheduler_stats(num_running=1, num_waiting=0, kv_cache_usage=0.75), [])
    assert value(logger, "tandem:num_requests_running") == 1
    assert value(logger, "tandem:num_requests_waiting") == 0
    assert value(logger, "tandem:kv_cache_usage_perc") == pytest.approx(0.75)


def test_cumulative_engine_counters_advance_by_the_difference(logger):
    logger.record_steps(
        scheduler_stats(prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1), []
    )
    assert value(logger, "tandem:prefix_cache_queries_total") == 100
    assert value(logger, "tandem:prefix_cache_hits_total") == 40
    assert value(logger, "tandem:num_preemptions_total") == 1
    logger.record_steps(
        scheduler_stats(prefix_cache_queries=250, prefix_cache_hits=90, num_preemptions=1), []
    )
    assert value(logger, "tandem:prefix_cache_queries_total") == 250
    assert value(logger, "tandem:prefix_cache_hits_total") == 90
    assert value(logger, "tandem:num_preemptions_total") == 1
    # The same totals again (a state-only report) add nothing.
    logger.record_steps(
        scheduler_stats(prefix_cache_queries=250, prefix_cache_hits=90, num_preemptions=1), []
    )
    assert value(logger, "tandem:prefix_cache_queries_total") == 250


def test_a_restarted_engine_count_is_added_not_subtracted(logger):
    logger.record_steps(scheduler_stats(prefix_cache_queries=100, num_preemptions=4), [])
    logger.record_steps(scheduler_stats(prefix_cache_queries=30, num_preemptions=1), [])
    assert value(logger, "tandem:prefix_cache_queries_total") == 130
    assert value(logger, "tandem:num_preemptions_total") == 5
    logger.record_steps(scheduler_stats(prefix_cache_queries=50, num_preemptions=1), [])
    assert value(logger, "tandem:prefix_cache_queries_total") == 150


# -- per-step histograms -------------------------------------------------------------------


def test_each_step_is_observed_once(logger):
    steps = [step(prefill=512, decode=3, seconds=0.080, seqs=4), step(0, 4, 0.012, seqs=4)]
    logger.record_steps(scheduler_stats(), steps)
    assert value(logger, "tandem:iteration_tokens_total_count") == 2
    assert value(logger, "tandem:iteration_tokens_total_sum") == 512 + 3 + 4
    assert value(logger, "tandem:step_prefill_tokens_count") == 2
    assert value(logger, "tandem:step_prefill_tokens_sum") == 512
    assert bucket(logger, "tandem:step_prefill_tokens", 0) == 1  # the pure-decode step
    assert value(logger, "tandem:step_decode_tokens_sum") == 7
    assert value(logger, "tandem:step_seqs_sum") == 8
    assert value(logger, "tandem:step_time_seconds_count") == 2
    assert value(logger, "tandem:step_time_seconds_sum") == pytest.approx(0.092)
    assert bucket(logger, "tandem:step_time_seconds", 0.015) == 1
    assert bucket(logger, "tandem:step_time_seconds", 0.075) == 1
    assert bucket(logger, "tandem:step_time_seconds", 0.1) == 2


def test_step_utilization_by_phase(logger):
    steps = [step(512, 0, 0.5), step(0, 4, 0.01), step(0, 4, 0.01), step(64, 4, 0.05)]
    for stats, mfu, mbu in zip(steps, (0.4, 0.01, 0.02, 0.1), (0.05, 0.6, 0.7, 0.3), strict=True):
        stats.mfu, stats.mbu = mfu, mbu
    logger.record_steps(scheduler_stats(), steps)
    for name in ("tandem:step_mfu", "tandem:step_mbu"):
        counts = [value(logger, name + "_count", phase=p) for p in ("prefill", "decode", "mixed")]
        assert counts == [1, 2, 1]
    assert value(logger, "tandem:step_mfu_sum", phase="decode") == pytest.approx(0.03)
    assert value(logger, "tandem:step_mbu_sum", phase="prefill") == pytest.approx(0.05)
    assert value(logger, "tandem:step_mbu_sum", phase="mixed") == pytest.approx(0.3)


def test_step_time_prediction_error(logger):
    steps = [step(0, 4, 0.010), step(0, 4, 0.020), step(0, 4, 0.010)]
    steps[0].predicted_step_time, steps[1].predicted_step_time = 0.012, 0.015
    logger.record_steps(scheduler_stats(), steps)  # the third has no forecast
    name = "tandem:step_time_prediction_error"
    assert value(logger, name + "_count") == 2
    assert value(logger, name + "_sum") == pytest.approx(0.2 + 0.25)


def test_a_state_only_report_observes_no_step(logger):
    logger.record_steps(scheduler_stats(num_running=2), [])
    assert value(logger, "tandem:step_time_seconds_count") == 0
    assert value(logger, "tandem:iteration_tokens_total_count") == 0


def test_the_log_lines_clock_starts_at_the_first_step_it_hears_of(caplog):
    """Steps come in batches (the engine works their telemetry out up to 16 at a time): a
    report before the first step's telemetry does not start the throughput clock, so the first
    line does not count the first steps' tokens over less than their time. Steps back to back
    from 0 s: a 1 s prefill, then 15 decode steps of 0.5 s, reported together at 8.5 s."""
    clock = iter([1.0, 8.5])
    stat_logger = LoggingStatLogger(interval=4.0, clock=lambda: next(clock))
    stat_logger.record_steps(scheduler_stats(), [])  # at 1 s: the prefill's telemetry waits
    with caplog.at_level(logging.INFO, logger="tandem.stats"):
        stat_logger.record_steps(scheduler_stats(), [step(512, 0, 1.0)] + [step(0, 1, 0.5)] * 15)
    assert "Avg prompt throughput: 60.2 tokens/s, Avg generation throughput: 1.8" in caplog.text


# -- finished sequences --------------------------------------------------------------------


def test_a_finished_sequence_fills_the_latency_histograms(logger):
    logger.record_finished(finished(completed_metrics(), prompt=7))
    assert value(logger, "tandem:request_success_total", finished_reason="stop") == 1
    assert value(logger, "tandem:request_success_total", finished_reason="length") == 0
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 1
    assert value(logger, "tandem:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    # ITL: every gap, 18, 27 and 45 ms, each in its own ms-scale bucket.
    itl = "tandem:inter_token_latency_seconds"
    assert value(logger, itl + "_count") == 3
    assert value(logger, itl + "_sum") == pytest.approx(0.09)
    cumulative = {0.015: 0, 0.02: 1, 0.025: 1, 0.03: 2, 0.04: 2, 0.05: 3, 0.1: 3}
    for le, count in cumulative.items():
        assert bucket(logger, itl, le) == count, le
    tpot = "tandem:request_time_per_output_token_seconds"
    assert value(logger, tpot + "_count") == 1
    assert value(logger, tpot + "_sum") == pytest.approx(0.03)
    expected = {
        "tandem:e2e_request_latency_seconds": 1.09,
        "tandem:request_queue_time_seconds": 0.5,
        "tandem:request_prefill_time_seconds": 0.5,
        "tandem:request_decode_time_seconds": 0.09,
        "tandem:request_inference_time_seconds": 0.59,
    }
    for name, seconds in expected.items():
        assert value(logger, name + "_count") == 1, name
        assert value(logger, name + "_sum") == pytest.approx(seconds), name
    assert value(logger, "tandem:prompt_tokens_total") == 7
    assert value(logger, "tandem:generation_tokens_total") == 4
    assert value(logger, "tandem:request_prompt_tokens_sum") == 7
    assert value(logger, "tandem:request_generation_tokens_sum") == 4


def test_ttft_and_itl_accumulate_over_sequences(logger):
    for ttft in (0.05, 0.25, 2.0):
        metrics = RequestMetrics(
            arrival_time=0.0,
            first_scheduled_time=0.0,
            first_token_time=ttft,
            finished_time=ttft + 0.01,
            token_times=[ttft, ttft + 0.01],
        )
        logger.record_finished(finished(metrics, reason="length"))
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 3
    assert value(logger, "tandem:time_to_first_token_seconds_sum") == pytest.approx(2.3)
    assert bucket(logger, "tandem:time_to_first_token_seconds", 0.06) == 1
    assert bucket(logger, "tandem:time_to_first_token_seconds", 0.3) == 2
    assert value(logger, "tandem:inter_token_latency_seconds_count") == 3
    assert value(logger, "tandem:inter_token_latency_seconds_sum") == pytest.approx(0.03)
    assert value(logger, "tandem:request_success_total", finished_reason="length") == 3


def test_abort_before_the_first_token_leaves_ttft_untouched(logger):
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, finished_time=3.0)
    logger.record_finished(finished(metrics, reason="abort", prompt=9))
    assert value(logger, "tandem:request_success_total", finished_reason="abort") == 1
    assert value(logger, "tandem:request_success_total", finished_reason="stop") == 0
    for name in (
        "tandem:time_to_first_token_seconds",
        "tandem:inter_token_latency_seconds",
        "tandem:request_time_per_output_token_seconds",
        "tandem:request_prefill_time_seconds",
        "tandem:request_decode_time_seconds",
        "tandem:request_inference_time_seconds",
    ):
        assert value(logger, name + "_count") == 0, name
        assert value(logger, name + "_sum") == 0, name
    # What it did live through is observed: it waited 0.5 s and was gone after 2 s.
    assert value(logger, "tandem:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(logger, "tandem:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    # Its prompt was never prefilled, so it is not a processed prompt token.
    assert value(logger, "tandem:prompt_tokens_total") == 0
    assert value(logger, "tandem:generation_tokens_total") == 0
    assert value(logger, "tandem:request_prompt_tokens_count") == 1


def test_abort_in_the_queue_records_only_its_outcome_and_e2e(logger):
    metrics = RequestMetrics(arrival_time=1.0, finished_time=1.25)
    logger.record_finished(finished(metrics, reason="abort"))
    assert value(logger, "tandem:request_success_total", finished_reason="abort") == 1
    assert value(logger, "tandem:request_queue_time_seconds_count") == 0
    assert value(logger, "tandem:e2e_request_latency_seconds_count") == 1


def test_abort_after_some_tokens_keeps_the_latencies_it_had(logger):
    metrics = completed_metrics()
    logger.record_finished(finished(metrics, reason="abort", prompt=5))
    assert value(logger, "tandem:request_success_total", finished_reason="abort") == 1
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 1
    assert value(logger, "tandem:inter_token_latency_seconds_count") == 3
    assert value(logger, "tandem:prompt_tokens_total") == 5
    assert value(logger, "tandem:generation_tokens_total") == 4


def test_a_one_token_sequence_has_no_tpot_or_decode_time(logger):
    metrics = RequestMetrics(
        arrival_time=0.0,
        first_scheduled_time=0.0,
        first_token_time=0.1,
        finished_time=0.1,
        token_times=[0.1],
    )
    logger.record_finished(finished(metrics, reason="length"))
    assert value(logger, "tandem:time_to_first_token_seconds_count") == 1
    assert value(logger, "tandem:inter_token_latency_seconds_count") == 0
    assert value(logger, "tandem:request_time_per_output_token_seconds_count") == 0
    assert value(logger, "tandem:request_decode_time_seconds_count") == 0
    assert value(logger, "tandem:request_inference_time_seconds_sum") == pytest.approx(0.1)


def test_an_unexpected_finish_reason_gets_its_own_series(logger):
    logger.record_finished(finished(completed_metrics(), reason="error"))
    assert value(logger, "tandem:request_success_total", finished_reason="error") == 1


# -- labels, help, instances, rendering ----------------------------------------------------


def test_every_tandem_metric_has_help_and_the_model_name_label(logger):
    logger.record_steps(scheduler_stats(), [step(4, 1, 0.01)])
    logger.record_finished(finished(completed_metrics()))
    body, _ = logger.render()
    families = [
        f
        for f in text_string_to_metric_families(body.decode())
        if f.name.startswith("tandem:") and not f.name.endswith("_created")
    ]
    assert len(families) >= 24
    for family in families:
        assert family.documentation, family.name
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample


def test_two_instances_do_not_collide():
    first, second = PrometheusStatLogger("a"), PrometheusStatLogger("b")
    first.record_steps(scheduler_stats(num_running=2, prefix_cache_queries=10), [])
    first.record_finished(finished(completed_metrics()))
    assert value(first, "tandem:num_requests_running") == 2
    assert value(second, "tandem:num_requests_running") == 0
    assert value(second, "tandem:prefix_cache_queries_total") == 0
    assert value(second, "tandem:time_to_first_token_seconds_count") == 0
    assert all(s.labels.get("model_name") != "a" for s in samples(second))


def test_a_given_registry_receives_the_metrics():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger(MODEL, registry=registry)
    logger.record_steps(scheduler_stats(num_waiting=4), [])
    labels = {"model_name": MODEL}
    assert registry.get_sample_value("tandem:num_requests_waiting", labels) == 4
    assert registry.get_sample_value("process_cpu_seconds_total") is None  # not added


def test_render_negotiates_the_format(logger):
    body, content_type = logger.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert b"# TYPE tandem:num_requests_running gauge" in body
    body, content_type = logger.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_latency_buckets_resolve_milliseconds_for_itl_and_seconds_for_ttft():
    decode_range = [b for b in STEP_TIME_BUCKETS if 0.005 <= b <= 0.1]
    assert len(decode_range) >= 10  # a 5-100 ms decode step lands in a narrow bucket
    assert max(TTFT_BUCKETS) >= 600


# -- the dashboard and the docs name only exported metrics ---------------------------------


def exported_names() -> set[str]:
    """Every sample name a logger that has seen each kind of input exposes."""
    logger = PrometheusStatLogger(MODEL)
    logger.record_steps(scheduler_stats(), [step(4, 1, 0.01)])
    logger.record_finished(finished(completed_metrics()))
    return {s.name for s in samples(logger) if s.name.startswith("tandem:")}


def exposed_metric_names() -> set[str]:
    """Metric names as queried: a counter with the `_total` its exposition adds."""
    body, _ = PrometheusStatLogger(MODEL).render()
    return {
        f.name + "_total" if f.type == "counter" else f.name
        for f in text_string_to_metric_families(body.decode())
        if f.name.startswith("tandem:") and not f.name.endswith("_created")
    }


def dashboard_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_dashboard_is_importable_and_queries_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dashboard["__inputs"]] == ["DS_PROMETHEUS"]
    assert "model_name" in {v["name"] for v in dashboard["templating"]["list"]}
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_names()
    referenced = set()
    for expr in dashboard_exprs(dashboard):
        names = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*:[a-zA-Z0-9_:]+", expr)
        assert names, expr
        assert set(names) <= exported, (set(names) - exported, expr)
        referenced |= set(names)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert 'model_name="$model_name"' in target["expr"], target["expr"]
    for needed in (
        "tandem:num_requests_running",
        "tandem:num_requests_waiting",
        "tandem:kv_cache_usage_perc",
        "tandem:time_to_first_token_seconds_bucket",
        "tandem:inter_token_latency_seconds_bucket",
        "tandem:request_time_per_output_token_seconds_bucket",
        "tandem:e2e_request_latency_seconds_bucket",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
        "tandem:prefix_cache_hits_total",
        "tandem:prefix_cache_queries_total",
        "tandem:num_preemptions_total",
        "tandem:step_prefill_tokens_sum",
        "tandem:step_decode_tokens_sum",
        "tandem:step_time_seconds_bucket",
    ):
        assert needed in referenced, needed


def test_docs_list_every_metric():
    documented = set(re.findall(r"`(tandem:[a-z0-9_:]+)`", DOCS.read_text()))
    missing = exposed_metric_names() - documented
    assert not missing, missing
