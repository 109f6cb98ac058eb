"""What the engine reports about itself: per-step telemetry, the scheduler's state after a
step, and one record per finished sequence. The offline LLM keeps them; the server turns them
into Prometheus metrics and log lines through `StatLogger`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tandem.outputs import RequestMetrics


@dataclass
class StepStats:
    """One step's telemetry: how much prefill and decode work it mixed, and what it cost."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_preempted: int
    step_time: float  # seconds, schedule to update
    kv_usage: float  # fraction of KV blocks in use after the step
    num_waiting: int
    num_running: int
    # Roofline (core/roofline.py): the step's counted work, where it sits against the
    # machine's peaks, and the bound its arithmetic intensity puts it under.
    flops: float = 0.0
    bytes: float = 0.0
    mfu: float = 0.0
    mbu: float = 0.0
    bound: str = ""  # "compute" or "memory"
    predicted_step_time: float = 0.0  # the step-cost model's forecast, before it saw this step
    # Speculative decoding: of the decode tokens, those that verified drafts, and the drafts
    # accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Seconds of step_time spent proposing drafts for the next step (the step-cost model
    # forecasts the rest).
    propose_time: float = 0.0
    # The rest of the step's composition as the step-cost model sees it (core/roofline.py's
    # BatchSums; its new tokens are the prefill and decode tokens above), so that a step log
    # can be replayed through a cost model offline (benchmarks/step_forecast.py).
    num_attended: int = 0
    num_context: int = 0
    num_sampled: int = 0
    # Multi-step scheduling: the forwards the step ran one after another for its one request
    # (its decode tokens, work and step_time are theirs together; the BatchSums above are
    # the first's).
    num_steps: int = 1

    @property
    def phase(self) -> str:
        """ "prefill", "decode" or "mixed": which kinds of tokens the step computed."""
        if self.num_prefill_tokens and self.num_decode_tokens:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"


@dataclass
class SchedulerStats:
    """The engine core's state now; counters are cumulative since start (Prometheus style)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests (cached free blocks are free)
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_steps: int
    num_requests_received: int  # add_request calls, refused ones included
    # Speculative decoding (SpecDecodeStats' counters, flat so the stats cross processes as
    # plain fields).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # Disaggregation. Prefill side: requests whose prompt KV was sent, its blocks and bytes,
    # holds that expired unpulled, blocks held now. Decode side: pulls that arrived, pulls
    # that failed (the prompt was computed here instead), blocks and bytes pulled, seconds
    # spent pulling, and prompt blocks not pulled because this instance had them cached.
    kv_num_sent: int = 0
    kv_sent_blocks: int = 0
    kv_sent_bytes: int = 0
    kv_num_expired: int = 0
    kv_held_blocks: int = 0
    kv_num_loaded: int = 0
    kv_num_load_failed: int = 0
    kv_loaded_blocks: int = 0
    kv_loaded_bytes: int = 0
    kv_load_seconds: float = 0.0
    kv_cached_blocks: int = 0


@dataclass
class FinishedRequestStats:
    """One finished sequence (a request with n > 1 gives n of these)."""

    request_id: str
    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    metrics: RequestMetrics


class StatLogger(Protocol):
    """Receives the engine's telemetry in the process that serves requests."""

    def record_steps(self, scheduler_stats: SchedulerStats, steps: list[StepStats]) -> None:
        """Called after each batch of engine-core steps (steps may be empty: state only)."""

    def record_finished(self, finished: FinishedRequestStats) -> None:
        """Called once per finished sequence, aborted ones included."""
