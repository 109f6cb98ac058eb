"""The periodic stats line of the offline engine (LLM(..., disable_log_stats=False)), as vLLM's
LoggingStatLogger writes it: throughput since the last line, requests running and waiting, KV
cache usage and prefix-cache hit rate, at most once per interval."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StepStats

logger = logging.getLogger("tandem.stats")

LOG_INTERVAL_SECONDS = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)


class LoggingStatLogger:
    """A StatLogger (engine/stats.py) that logs a summary line every `interval` seconds."""

    def __init__(
        self, interval: float = LOG_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.last_time: float | None = None  # the first step starts the clock, not the load
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.last_queries = self.last_hits = 0

    def record_steps(self, scheduler_stats: SchedulerStats, steps: list[StepStats]) -> None:
        now = self.clock()
        if self.last_time is None:
            if not steps:
                return  # the first step starts the clock (its telemetry may come later)
            self.last_time = now - sum(step.step_time for step in steps)
        for step in steps:
            self.prefill_tokens += step.num_prefill_tokens
            self.decode_tokens += step.num_decode_tokens
        elapsed = now - self.last_time
        if elapsed < self.interval:
            return
        stats = scheduler_stats
        queries = stats.prefix_cache_queries - self.last_queries
        hits = stats.prefix_cache_hits - self.last_hits
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self.prefill_tokens / elapsed,
            self.decode_tokens / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * hits / queries if queries > 0 else 0.0,
        )
        self.last_time = now
        self.prefill_tokens = self.decode_tokens = 0
        self.last_queries, self.last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits

    def record_finished(self, finished: FinishedRequestStats) -> None:
        pass
