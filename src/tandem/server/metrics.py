"""Prometheus metrics for the server's `/metrics` endpoint.

`PrometheusStatLogger` is a `StatLogger` (engine/stats.py): it turns the engine's telemetry into
metrics named `tandem:` + vLLM's name for the same meaning, so a vLLM dashboard needs only a
prefix change. Every metric, its unit and when it is recorded: docs/metrics.md.

Request-level figures (latencies, token counts) are recorded once, when a sequence finishes, from
its `RequestMetrics`; step-level figures after every batch of engine steps; counters the engine
keeps cumulatively (prefix cache, preemptions) advance by the difference since the last report.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StepStats
from tandem.outputs import RequestMetrics

PREFIX = "tandem:"
FINISH_REASONS = ("stop", "length", "abort")  # series that exist (at 0) from the start

# Buckets, chosen for the quantity. A decode step of a 135M model takes ~10-100 ms on a 2-core
# CPU and ~5-50 ms on a GPU (a few ms with CUDA graphs), so step time and the gaps a stream sees
# (ITL, TPOT) need ms resolution there, and a tail to seconds for steps that carry a long prefill.
STEP_TIME_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# TTFT and its two parts (queue, prefill): ms when idle, up to minutes behind a long queue.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# Whole requests and their long parts (decode, inference): 10 ms to half an hour.
REQUEST_TIME_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
# Tokens in one request: 1-2-5 steps up to a 128k context.
REQUEST_TOKEN_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
)  # fmt: skip
# Tokens or sequences in one step: powers of two up to a large budget; le="0" counts the steps
# that had none of that kind (e.g. pure-decode steps for prefill tokens).
STEP_TOKEN_BUCKETS = (0, *(2**i for i in range(15)))  # 0, 1, 2, 4, ..., 16384
STEP_SEQ_BUCKETS = (0, *(2**i for i in range(11)))  # 0, 1, 2, 4, ..., 1024
# A fraction of a peak: log-spaced below 10% (decode on a CPU sits there), linear above.
UTILIZATION_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
)  # fmt: skip
STEP_PHASES = ("prefill", "decode", "mixed")
# Sampling to SSE write: the serving path's own cost, fine below 10 ms (the goal is p99 < 5 ms:
# the 4.5 ms edge tells a p99 just under it from one at it).
DELIVERY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.0045, 0.005, 0.0075, 0.01, 0.015,
    0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


def inference_time(metrics: RequestMetrics) -> float | None:
    """First scheduled to last token: vLLM's RUNNING phase (prefill + decode, preemptions in)."""
    if metrics.first_scheduled_time is None or not metrics.token_times:
        return None
    return metrics.token_times[-1] - metrics.first_scheduled_time


# Disaggregation's cumulative counters: (metric name, SchedulerStats field, documentation).
KV_TRANSFER_COUNTERS = (
    ("kv_transfer_sent_requests", "kv_num_sent",
     "Prefill role: requests whose prompt KV was sent to a decode instance."),
    ("kv_transfer_sent_blocks", "kv_sent_blocks", "Prefill role: KV blocks sent."),
    ("kv_transfer_sent_bytes", "kv_sent_bytes", "Prefill role: KV bytes sent."),
    ("kv_transfer_expired_requests", "kv_num_expired",
     "Prefill role: prompts whose KV no decode instance pulled within the hold time."),
    ("kv_transfer_loaded_requests", "kv_num_loaded",
     "Decode role: requests whose prompt KV arrived from a prefill instance."),
    ("kv_transfer_failed_requests", "kv_num_load_failed",
     "Decode role: KV pulls that failed or timed out; the prompt was computed here instead."),
    ("kv_transfer_loaded_blocks", "kv_loaded_blocks", "Decode role: KV blocks pulled."),
    ("kv_transfer_loaded_bytes", "kv_loaded_bytes", "Decode role: KV bytes pulled."),
    ("kv_transfer_load_seconds", "kv_load_seconds",
     "Decode role: seconds spent pulling KV (connecting included)."),
    ("kv_transfer_cached_blocks", "kv_cached_blocks",
     "Decode role: prompt blocks found in this instance's prefix cache, so not pulled."),
)  # fmt: skip


class PrometheusStatLogger:
    """A StatLogger that keeps Prometheus metrics for one served model.

    Each instance owns its metrics, in a private registry unless one is given (so tests and
    several servers in one process do not collide). A private registry also gets
    prometheus_client's process, platform and GC collectors, as the default registry has: the
    API process's CPU time is what it costs the step loop on a small machine.
    The server answers GET /metrics with `body, content_type = logger.render(accept_header)`.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            prometheus_client.ProcessCollector(registry=registry)
            prometheus_client.PlatformCollector(registry=registry)
            prometheus_client.GCCollector(registry=registry)
        self.registry = registry
        self.model_name = model_name
        self._lock = threading.Lock()  # guards the last cumulative totals seen
        self._last_totals: dict[str, int] = {}

        # Scheduler state, as of the latest report.
        self.num_requests_running = self._gauge(
            "num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Number of requests waiting to be scheduled (incl. preempted)."
        )
        self.kv_cache_usage_perc = self._gauge(
            "kv_cache_usage_perc",
            "KV-cache usage: fraction of blocks held by requests (1 means 100 percent).",
        )
        # Counters the engine keeps cumulatively.
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried prompt tokens.",
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached prompt tokens "
            "(recomputation after preemption is not a hit).",
        )
        self.num_preemptions = self._counter(
            "num_preemptions", "Cumulative number of preemptions from the engine."
        )
        self.spec_decode_num_drafts = self._counter(
            "spec_decode_num_drafts", "Speculative decoding: verifications (a request's drafts)."
        )
        self.spec_decode_num_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted draft tokens by position in their draft (0: first).",
            ["model_name", "position"],
            registry=registry,
        )
        # Disaggregation: (counter name, SchedulerStats field, what it counts).
        self.kv_transfer_counters = {
            field: (self._counter(name, documentation), field)
            for name, field, documentation in KV_TRANSFER_COUNTERS
        }
        self._kv_endpoint: Gauge | None = None  # prefill role only: kv_transfer_endpoint()
        self.kv_transfer_held_blocks = self._gauge(
            "kv_transfer_held_blocks",
            "Prefill role: KV blocks kept for decode instances to pull (finished prompts' "
            "blocks held in the cache, and blocks copied out for streams and not sent yet).",
        )
        # Per finished sequence.
        self.prompt_tokens = self._counter(
            "prompt_tokens",
            "Number of prompt tokens processed (cached ones included), counted when a sequence "
            "whose prompt was prefilled finishes.",
        )
        self.generation_tokens = self._counter(
            "generation_tokens",
            "Number of generation tokens produced, counted when their sequence finishes.",
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Count of finished sequences, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens",
            "Number of prompt tokens per finished sequence.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens",
            "Number of generation tokens per finished sequence.",
            REQUEST_TOKEN_BUCKETS,
        )
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds",
            "Time to first token (arrival to first output token) in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds",
            "Inter-token latency in seconds: every gap between consecutive output tokens.",
            STEP_TIME_BUCKETS,
        )
        self.request_time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds",
            "Mean time per output token after the first, per sequence, in seconds "
            "(sequences of one token have none).",
            STEP_TIME_BUCKETS,
        )
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds",
            "End-to-end latency in seconds: arrival to finish (to abort for aborted ones).",
            REQUEST_TIME_BUCKETS,
        )
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds",
            "Time spent waiting before first scheduled (WAITING phase), in seconds.",
            TTFT_BUCKETS,
        )
        self.request_prefill_time = self._histogram(
            "request_prefill_time_seconds",
            "Time from first scheduled to first token (PREFILL phase), in seconds.",
            TTFT_BUCKETS,
        )
        self.request_decode_time = self._histogram(
            "request_decode_time_seconds",
            "Time from first to last token (DECODE phase), in seconds.",
            REQUEST_TIME_BUCKETS,
        )
        self.request_inference_time = self._histogram(
            "request_inference_time_seconds",
            "Time from first scheduled to last token (RUNNING phase: prefill + decode), "
            "in seconds.",
            REQUEST_TIME_BUCKETS,
        )
        # Per engine step.
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total",
            "Number of tokens computed per engine step (prefill + decode).",
            STEP_TOKEN_BUCKETS,
        )
        self.step_prefill_tokens = self._histogram(
            "step_prefill_tokens",
            "Number of prompt tokens computed per engine step (cache hits are not computed).",
            STEP_TOKEN_BUCKETS,
        )
        self.step_decode_tokens = self._histogram(
            "step_decode_tokens",
            "Number of decode tokens computed per engine step.",
            STEP_TOKEN_BUCKETS,
        )
        self.step_seqs = self._histogram(
            "step_seqs", "Number of sequences in an engine step's batch.", STEP_SEQ_BUCKETS
        )
        self.step_time = self._histogram(
            "step_time_seconds",
            "Engine step time (schedule to update) in seconds.",
            STEP_TIME_BUCKETS,
        )
        # Roofline, by phase mix: achieved over the machine's peaks (logged at start).
        self.step_mfu = self._phase_histogram(
            "step_mfu", "Model FLOPs utilization of each engine step (achieved / peak FLOP/s)."
        )
        self.step_mbu = self._phase_histogram(
            "step_mbu",
            "Memory bandwidth utilization of each engine step (achieved / peak bytes/s).",
        )

        self.step_time_prediction_error = self._histogram(
            "step_time_prediction_error",
            "Relative error of the step-cost model's forecast of each step's time, "
            "|predicted - measured| / measured (the ITL target relies on it).",
            UTILIZATION_BUCKETS,
        )

        self.token_delivery = self._histogram(
            "token_delivery_seconds",
            "Time from a token's sampling in the engine core to its streamed (SSE) chunk being "
            "written by the API process, in seconds: what the serving path adds to each token.",
            DELIVERY_BUCKETS,
        )

    def record_token_delivery(self, now: float, token_times: Sequence[float]) -> None:
        """`token_times`: when each token just written was sampled (time.monotonic)."""
        for sampled_at in token_times:
            self.token_delivery.observe(now - sampled_at)

    # -- StatLogger -------------------------------------------------------------------------

    def record_steps(self, scheduler_stats: SchedulerStats, steps: list[StepStats]) -> None:
        """Set the state gauges, advance the cumulative counters, observe each step."""
        stats = scheduler_stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_transfer_held_blocks.set(stats.kv_held_blocks)
        with self._lock:
            self._advance(
                self.prefix_cache_queries, "prefix_cache_queries", stats.prefix_cache_queries
            )
            self._advance(self.prefix_cache_hits, "prefix_cache_hits", stats.prefix_cache_hits)
            self._advance(self.num_preemptions, "num_preemptions", stats.num_preemptions)
            self._advance(self.spec_decode_num_drafts, "spec_drafts", stats.spec_num_drafts)
            self._advance(
                self.spec_decode_num_draft_tokens, "spec_draft_tokens", stats.spec_num_draft_tokens
            )
            self._advance(
                self.spec_decode_num_accepted_tokens, "spec_accepted_tokens",
                stats.spec_num_accepted_tokens,
            )  # fmt: skip
            for counter, field in self.kv_transfer_counters.values():
                self._advance(counter, field, getattr(stats, field))
            for position, total in enumerate(stats.spec_accepted_per_position):
                self._advance(
                    self.spec_decode_num_accepted_tokens_per_pos.labels(
                        self.model_name, str(position)
                    ),
                    f"spec_accepted_at_{position}",
                    total,
                )
        for step in steps:
            self.iteration_tokens.observe(step.num_prefill_tokens + step.num_decode_tokens)
            self.step_prefill_tokens.observe(step.num_prefill_tokens)
            self.step_decode_tokens.observe(step.num_decode_tokens)
            self.step_seqs.observe(step.num_seqs)
            self.step_time.observe(step.step_time)
            self.step_mfu[step.phase].observe(step.mfu)
            self.step_mbu[step.phase].observe(step.mbu)
            forecast_part = step.step_time - step.propose_time  # what the model forecasts
            if forecast_part > 0 and step.predicted_step_time > 0:
                error = abs(step.predicted_step_time - forecast_part) / forecast_part
                self.step_time_prediction_error.observe(error)

    def record_finished(self, finished: FinishedRequestStats) -> None:
        """Count the sequence and observe every interval it lived through (None: not reached)."""
        metrics = finished.metrics
        self.request_success.labels(self.model_name, finished.finish_reason).inc()
        if metrics.first_token_time is not None:  # its prompt was prefilled
            self.prompt_tokens.inc(finished.num_prompt_tokens)
        self.generation_tokens.inc(finished.num_generation_tokens)
        self.request_prompt_tokens.observe(finished.num_prompt_tokens)
        self.request_generation_tokens.observe(finished.num_generation_tokens)
        intervals = (
            (self.time_to_first_token, metrics.ttft),
            (self.request_time_per_output_token, metrics.tpot),
            (self.e2e_request_latency, metrics.e2e_latency),
            (self.request_queue_time, metrics.queue_time),
            (self.request_prefill_time, metrics.prefill_time),
            (self.request_decode_time, metrics.decode_time),
            (self.request_inference_time, inference_time(metrics)),
        )
        for histogram, seconds in intervals:
            if seconds is not None:
                histogram.observe(seconds)
        for gap in metrics.inter_token_latencies:
            self.inter_token_latency.observe(gap)

    # -- /metrics ---------------------------------------------------------------------------

    def render(self, accept_header: str | None = None) -> tuple[bytes, str]:
        """The /metrics response body and its content type, negotiated from the request's
        Accept header as prometheus_client's own handlers do (none: Prometheus text 0.0.4)."""
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(self.registry), content_type

    # -- helpers ----------------------------------------------------------------------------

    def _advance(self, counter: Counter, key: str, total: float) -> None:
        """Increase `counter` by how far the engine's cumulative `total` moved since last time.
        A smaller total means the engine restarted its count: all of it is new."""
        last = self._last_totals.get(key, 0)
        counter.inc(total - last if total >= last else total)
        self._last_totals[key] = total

    def kv_transfer_endpoint(self, host: str, port: int) -> None:
        """Prefill role: where decode instances pull KV from, as labels of a constant 1 (the
        router reads it to send a request's two legs at once)."""
        if self._kv_endpoint is None:
            self._kv_endpoint = Gauge(
                PREFIX + "kv_transfer_endpoint",
                "Prefill role: the host and port decode instances pull KV from (value 1).",
                ["model_name", "host", "port"],
                registry=self.registry,
            )
        self._kv_endpoint.labels(self.model_name, host, str(port)).set(1)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        metric = Gauge(PREFIX + name, documentation, ["model_name"], registry=self.registry)
        return metric.labels(self.model_name)

    def _counter(self, name: str, documentation: str) -> Counter:
        metric = Counter(PREFIX + name, documentation, ["model_name"], registry=self.registry)
        return metric.labels(self.model_name)

    def _phase_histogram(self, name: str, documentation: str) -> dict[str, Histogram]:
        metric = Histogram(
            PREFIX + name,
            documentation,
            ["model_name", "phase"],
            registry=self.registry,
            buckets=UTILIZATION_BUCKETS,
        )
        return {phase: metric.labels(self.model_name, phase) for phase in STEP_PHASES}

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        metric = Histogram(
            PREFIX + name, documentation, ["model_name"], registry=self.registry, buckets=buckets
        )
        return metric.labels(self.model_name)
