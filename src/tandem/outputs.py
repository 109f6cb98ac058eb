"""What generate() returns: vLLM's RequestOutput / CompletionOutput shapes, plus per-request
timing that shows the prefill/decode split (TTFT vs inter-token latency)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token under the model's raw distribution
    decoded_token: str | None = None


# One entry per prompt token: None for the first (nothing predicts it), then the token's logprob
# with its rank plus the top-N at that position, in the shape of CompletionOutput.logprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one sequence's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Speculative decoding: draft tokens verified for this sequence, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Every gap between consecutive output tokens (ITL)."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def decode_time(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return self.token_times[-1] - self.token_times[0]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        decode_time = self.decode_time
        return None if decode_time is None else decode_time / (len(self.token_times) - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: the whole list, in the first output that has it (DELTA
    # outputs carry it once); None otherwise.
    prompt_logprobs: PromptLogprobs | None = None
    # Disaggregation: from a prefill instance, where the prompt's KV waits for a decode
    # instance (vLLM's field; set on the finished output).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
