"""What the scheduler is told: the step's token budget and seats, the longest request, how
prompts are chunked, the batching policy (decode-first / prefill-first) and the queue order
(vLLM's scheduling_policy: fcfs / priority). Validated when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.core.request_queue import SCHEDULING_POLICIES, SchedulingPolicy

BatchingPolicy = Literal["decode-first", "prefill-first"]
BATCHING_POLICIES: tuple[BatchingPolicy, ...] = ("decode-first", "prefill-first")
_POSITIVE_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "max_num_partial_prefills",
    "num_scheduler_steps",
)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # requests running at once (seats)
    max_model_len: int = 2048  # prompt + output tokens of one request
    max_num_partial_prefills: int = 1  # prompts left mid-prefill at once (decode-first)
    # Most tokens one request may compute in a step (decode-first). 0 = auto: half the token
    # budget, so a long prompt never takes a whole step and short prompts arriving behind it
    # still start at once. (vLLM's auto value, 4% of max_model_len, would cut a lone 2k-token
    # prompt into 26 steps.)
    long_prefill_token_threshold: int = 0
    batching_policy: BatchingPolicy = "decode-first"
    scheduling_policy: SchedulingPolicy = "fcfs"  # queue order: "fcfs" or "priority" (vLLM's)
    # False: a prompt is never cut into chunks; it waits until the step has room for all of it
    # (vLLM's semantics), so max_num_batched_tokens must be >= max_model_len.
    enable_chunked_prefill: bool = True
    # ITL target (decode-first): each step's prefill is sized so the step's predicted time
    # stays within this many seconds (the decodes always run). None: the fixed token budget.
    target_step_time: float | None = None
    # Speculative decoding: the most draft tokens a request verifies in a step (0: off), with
    # how many chosen per request and step by the step-cost model (adaptive) or all the
    # proposer found; none in steps with at least `speculation_max_running` requests running.
    num_speculative_tokens: int = 0
    adaptive_speculation: bool = True
    speculation_max_running: int | None = None
    # Multi-step scheduling (vLLM v0's num_scheduler_steps): the most forwards one step runs
    # when its work is plainly sampled decodes verifying no drafts, each fed the token the one
    # before chose (scheduler.py _schedule_steps). 1: one. Such steps of up to
    # multi_step_max_seqs requests (the model runner's max_burst_rows: the engine core sets it).
    num_scheduler_steps: int = 1
    multi_step_max_seqs: int = 1

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = auto), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), or running requests could not all decode in one step"
            )
        if self.target_step_time is not None:
            if not 0 < self.target_step_time < float("inf"):
                raise ValueError(
                    f"the ITL target must be a positive time, got {self.target_step_time} s"
                )
            if self.batching_policy != "decode-first" or not self.enable_chunked_prefill:
                raise ValueError(
                    "an ITL target sizes prefill chunks around decodes: it needs "
                    "batching_policy='decode-first' and enable_chunked_prefill=True"
                )
        if self.batching_policy not in BATCHING_POLICIES:
            raise ValueError(
                f"batching_policy must be one of {', '.join(BATCHING_POLICIES)}, "
                f"got {self.batching_policy!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                f"{self.scheduling_policy!r} (decode-first / prefill-first is batching_policy)"
            )
        if not self.enable_chunked_prefill:
            if self.long_prefill_token_threshold:
                raise ValueError(
                    "long_prefill_token_threshold cuts prompts into chunks: leave it at 0 with "
                    "enable_chunked_prefill=False"
                )
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"with enable_chunked_prefill=False a prompt runs whole in one step, so "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                    f"max_model_len ({self.max_model_len}): raise it or lower max_model_len"
                )

    @property
    def long_prefill_token_limit(self) -> int:
        """long_prefill_token_threshold resolved: the most tokens one request computes in a
        decode-first step (the whole budget without chunked prefill)."""
        if not self.enable_chunked_prefill:
            return self.max_num_batched_tokens
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 2)
