"""One generation request as the scheduler sees it: its tokens, its progress, its timeline."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.kv_transfer.params import RemotePrefill

# An output token sampled by a step still in flight (async scheduling): its id is known only
# when that step completes, but the next step is scheduled, and computes it, before then.
PLACEHOLDER_TOKEN_ID = -1


class FinishReason(str, enum.Enum):
    """The OpenAI `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again, its KV freed; it will recompute its tokens
    # Disaggregation (decode side): blocks allocated, its prompt's KV on the way from the
    # prefill instance that computed it.
    WAITING_FOR_REMOTE_KV = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


# Identity equality: requests sit in queues that search by `is`/`==`. Slots: the step loop
# reads a few fields of every running request each step, and a slotted object keeps them
# together in one small block instead of a dict of its own.
@dataclass(eq=False, slots=True)
class Request:
    """Prompt and output tokens live in one list, `all_token_ids`, which only grows; the scheduler
    moves `num_computed_tokens` towards `num_tokens` (KV computed vs tokens known). Timestamps
    come from the scheduler's clock (time.monotonic by default), the same clock as arrival_time."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Extra key of the prefix-cache hash of the first block, so the whole chain: requests with
    # different salts (tenants that must not share) never share cached blocks.
    cache_salt: str | None = None
    # vLLM's request priority: with scheduling_policy="priority", lower values are admitted
    # first and preempted last; ties go by arrival_time. Must stay 0 under "fcfs".
    priority: int = 0

    output_token_ids: list[int] = field(init=False, default_factory=list)
    all_token_ids: list[int] = field(init=False)
    # len(prompt_token_ids), which never changes: the step loop compares it with
    # num_computed_tokens for every running request, without reading the prompt's list.
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    num_preemptions: int = field(init=False, default=0)
    # Prompt tokens found in the prefix cache at first admission (recompute after a preemption
    # is not a cache hit, so it is never counted).
    num_cached_tokens: int = field(init=False, default=0)
    # The stop token id or stop string that ended the request; None for EOS, length and abort.
    stop_reason: int | str | None = field(init=False, default=None)
    first_scheduled_time: float | None = field(init=False, default=None)
    first_token_time: float | None = field(init=False, default=None)
    # When its newest token was sampled (the core sends each step's tokens with their time;
    # the front end keeps one per token).
    last_token_time: float | None = field(init=False, default=None)
    finished_time: float | None = field(init=False, default=None)
    # Speculative decoding: the proposer's guesses of the tokens after the last one (the
    # scheduler verifies some or all of them in the next step), and what verification did
    # with this request's drafts so far (the scheduler estimates its acceptance rate from them).
    # Replaced, never changed in place: none is one shared empty tuple, which the step loop's
    # check of every running request reads without touching a list of each request's own.
    spec_token_ids: Sequence[int] = field(init=False, default=())
    num_draft_tokens: int = field(init=False, default=0)
    num_accepted_tokens: int = field(init=False, default=0)
    # Accepted drafts and rejections (a verification rejects at most one), decayed so that
    # the estimate follows the request's recent text: the scheduler's acceptance estimate.
    recent_accepted: float = field(init=False, default=0.0)
    recent_rejections: float = field(init=False, default=0.0)
    # Disaggregation. Prefill side: keep the prompt's blocks when the request finishes, for a
    # decode instance to pull. Decode side: where the prompt's KV waits (the request arrives
    # with its first token; set until the KV has arrived or the pull failed).
    hold_kv: bool = field(init=False, default=False)
    remote_prefill: RemotePrefill | None = field(init=False, default=None)
    # Plain greedy with nothing to report (worker/sampler.argmax_only), set by the engine core
    # when it takes the request: a batch of such rows samples by argmax alone.
    argmax_only: bool = field(init=False, default=False)
    # Sampled from the raw logits with nothing to report (worker/sampler.plain_sampling): the
    # C sampler's row, which multi-step scheduling's bursts draw for; set with argmax_only.
    plain_sampling: bool = field(init=False, default=False)
    # Set by the scheduler when it takes the request, so that the step loop's stop check is a
    # set lookup and a comparison: the token ids that may end it (min_tokens aside), and the
    # token count at which it ends by length (0: check every token in full).
    stop_check_ids: frozenset[int] = field(init=False, default=frozenset())
    length_limit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not in the cache yet: what the scheduler has left to give."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_done(self) -> bool:
        """The whole prompt is in the KV cache; from here on the request is decoding."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
