"""Decides, each step, how many tokens every request computes.

There are no prefill and decode modes: a request has `num_computed_tokens` (KV in the cache) and
`num_tokens` (prompt + generated), and a step gives it new tokens so the first catches up with
the second. A prompt chunk and a decode token differ only in how many tokens that is. A request
samples a token in the step that catches it up.

Two batching policies over this one model (`batching_policy`):
- decode-first (stall-free, as Sarathi-Serve): running decodes get their token first, then
  in-flight prompt chunks, then new requests, in one mixed batch;
- prefill-first (the classic one): a step runs whole prompts only, or decodes only, never both.

Which waiting request comes next is vLLM's `scheduling_policy` (request_queue.py): `fcfs`
(arrival order) or `priority` (lowest value first, arrival order among equals). Out of KV
blocks, the last running request in that order is preempted (fcfs: the newest; priority: the
highest value, latest arrival) and later recomputes its tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.core.block_pool import KVCacheBlock
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import EngineCoreOutput, StepUpdate, core_output
from tandem.core.request_queue import SCHEDULING_POLICIES, SchedulingPolicy, make_request_queue
from tandem.core.roofline import BatchSums, request_sums
from tandem.core.scheduler_config import BATCHING_POLICIES, BatchingPolicy, SchedulerConfig
from tandem.core.spec_guard import SpeculationGuard
from tandem.core.spec_stats import SpecDecodeStats
from tandem.kv_transfer.params import KVLoad
from tandem.outputs import Logprob
from tandem.records import record
from tandem.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus

__all__ = [
    "BATCHING_POLICIES",
    "SCHEDULING_POLICIES",
    "BatchingPolicy",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
]


@record()
class ScheduledRequest:
    """What the model runner needs for one request this step."""

    request_id: str
    token_ids: list[int]  # the request's all_token_ids (the live list, not a copy)
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    block_ids: list[int]  # the request's whole block table (the live list, not a copy)
    sample: bool  # this step reaches the last known token, so a new token is sampled
    # Guessed tokens after the last known one, computed (and counted in num_new_tokens) to be
    # verified: the step samples at the last known token and at every draft.
    draft_token_ids: list[int]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prompt chunks
    requests: list[Request]  # the request of each entry of `scheduled`, in the same order
    total_num_scheduled_tokens: int
    # Telemetry. Decode: a request already running with its prompt computed; everything else
    # (prompt chunks, recompute after preemption) counts as prefill.
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted_request_ids: list[str]
    finished_request_ids: list[str]  # finished or aborted since the previous schedule()
    sums: BatchSums  # what the step's cost depends on (core/roofline.py), summed while planning
    num_draft_tokens: int = 0  # of the decode tokens, those that verify guesses
    # Multi-step scheduling: the forwards the step runs one after another, each decoding the
    # token the one before chose (plainly sampled decodes alone; 1: one forward, as in any step).
    num_steps: int = 1
    # Disaggregation (decode side): prompt KV to pull for requests whose blocks were allocated
    # this step; they compute nothing until it has arrived.
    kv_loads: list[KVLoad] = field(default_factory=list)

    def sampling_requests(self) -> list[Request]:
        """The requests of the entries that sample, in order: `requests` itself where every
        entry samples, as in most steps (the sums count each sampling entry and its drafts,
        so no look at each entry is needed to tell)."""
        if self.sums.num_sampled - self.num_draft_tokens == len(self.scheduled):
            return self.requests
        return [r for r, s in zip(self.requests, self.scheduled, strict=True) if s.sample]


class StepCostPredictor(Protocol):
    """Seconds a step of these sums will take (core/step_cost.py fits one online)."""

    packed_max_tokens: int  # the largest step that multiplies packed weights (0: none do)
    # How far recent steps with prompt chunks ran over their forecasts (a fraction): an ITL
    # target plans within target / (1 + headroom), so that a step the forecast misses still
    # keeps near the target.
    headroom: float
    # The most new tokens of any step it has seen: under a target, prompt chunks fill a step
    # to at most twice that (a line fitted on small chunks may promise a far larger one in a
    # fraction of its time), so a first long prompt's chunks grow 32, 64, 128, ... tokens.
    max_observed_tokens: int

    def predict(self, sums: BatchSums) -> float: ...


# With an ITL target, a step where no prompt tokens fit still takes up to this many (as many as
# keep it within the target itself, at least one; all where its decodes alone pass the
# target), so that prompts always progress (no starvation under heavy decode load).
MIN_PREFILL_TOKENS = 16
# Acceptance estimates: a request's own counts are blended with the engine-wide rate as if it
# had this many verifications of that rate, and decay by this factor at each verification (and
# each step a low estimate keeps it from drafting, so it tries again later).
ACCEPTANCE_PRIOR_WEIGHT = 2.0
ACCEPTANCE_DECAY = 0.9
# Adaptive speculation verifies drafts only when the step-cost model says they raise the
# step's expected tokens per second by at least this much: the model's error (~5-10% per
# step) must not turn a forecast gain into a loss.
MIN_SPECULATION_GAIN = 0.05
# Multi-step scheduling keeps a burst within this many seconds (forecast), or the ITL target
# where shorter: the burst's tokens reach the client together, at least once per display
# frame (60 Hz), and a request that arrives meanwhile waits at most this long for a seat.
MULTI_STEP_WINDOW = 0.016
# The draft_token_ids of every entry without drafts (read only: one list, not one per entry).
_NO_DRAFTS: list[int] = []


@dataclass
class _StepPlan:
    """The step being built: request id -> (request, new tokens), in scheduling order, and the
    sums its cost is predicted from (kept as plain counts: a plan of a thousand decodes adds a
    thousand entries)."""

    token_budget: int
    # The third item: the step's entry for the request where planning built it (a decode
    # gathered in one go, while its fields were at hand); None: _build_output builds it.
    entries: dict[str, tuple[Request, int, ScheduledRequest | None]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    admitted: set[str] = field(default_factory=set)
    has_prefill: bool = False  # a prompt chunk was sized against the ITL target
    drafts: dict[str, int] = field(default_factory=dict)  # request id -> draft tokens
    kv_loads: list[KVLoad] = field(default_factory=list)
    num_steps: int = 1  # multi-step scheduling's forwards (SchedulerOutput.num_steps)
    # BatchSums' fields, summed over the entries.
    num_new_tokens: int = 0
    num_attended: int = 0
    num_context: int = 0
    num_sampled: int = 0

    @property
    def sums(self) -> BatchSums:
        return BatchSums(self.num_new_tokens, self.num_attended, self.num_context,
                         self.num_sampled)  # fmt: skip

    def add(self, request: Request, num_new_tokens: int, num_drafts: int = 0) -> None:
        """Schedule the request's tokens (a request already planned is replanned in place,
        keeping its place in the order)."""
        request_id = request.request_id
        if request_id in self.entries:
            self._count(request, self.entries[request_id][1], self.drafts.pop(request_id, 0), -1)
        self.entries[request_id] = (request, num_new_tokens, None)
        self._count(request, num_new_tokens, num_drafts, 1)
        if num_drafts:
            self.drafts[request_id] = num_drafts

    def add_decodes(
        self, decodes: dict[str, tuple[Request, int, ScheduledRequest | None]], num_context: int
    ) -> None:
        """add(request, 1) for requests not planned yet whose one token is their last, given
        as their `entries` items (the new tokens 1; the step's entry if built);
        `num_context`: the sum of their num_computed_tokens + 1."""
        self.entries.update(decodes)
        count = len(decodes)
        self.token_budget -= count
        self.num_new_tokens += count
        self.num_attended += num_context
        self.num_context += num_context
        self.num_sampled += count

    def _count(self, request: Request, num_new: int, num_drafts: int, sign: int) -> None:
        """Add (sign 1) or take out (-1) an entry's part (request_sums) of the sums and
        budget; the request's counts do not change while a step is planned."""
        before = request.num_computed_tokens
        sample = before + num_new - num_drafts == request.num_tokens
        self.token_budget -= sign * num_new
        self.num_new_tokens += sign * num_new
        self.num_attended += sign * (num_new * before + num_new * (num_new + 1) // 2)
        self.num_context += sign * (before + num_new)
        self.num_sampled += sign * ((1 + num_drafts) if sample else 0)

    def num_new_tokens_of(self, request: Request) -> int:
        entry = self.entries.get(request.request_id)
        return 0 if entry is None else entry[1]

    def drop(self, request: Request) -> None:
        entry = self.entries.pop(request.request_id, None)
        if entry is not None:
            self._count(request, entry[1], self.drafts.pop(request.request_id, 0), -1)


def all_greedy(requests: Iterable[Request]) -> bool:
    """Whether every one of these requests decodes greedily (the speculation guard keeps
    their batches' verdicts apart)."""
    return all(request.sampling_params.is_greedy for request in requests)


def _num_decodes(plan: _StepPlan) -> int:
    return sum(1 for request, _, _ in plan.entries.values() if request.is_prefill_done)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        cost_model: StepCostPredictor | None = None,
    ) -> None:
        if config.target_step_time is not None and cost_model is None:
            raise ValueError("an ITL target needs a step-cost model to size prefill chunks")
        self.config = config
        self.cost_model = cost_model
        self.kv_cache_manager = kv_cache_manager
        self.clock = clock
        # A request may not outgrow the whole cache either: alone, it always fits.
        self.max_model_len = min(config.max_model_len, kv_cache_manager.max_num_tokens)
        self.requests: dict[str, Request] = {}  # unfinished requests
        self._arrival_order: dict[str, int] = {}  # ties of equal priority and arrival time
        self._next_arrival = itertools.count()
        # In admission order (request_queue.py); preempted requests go back in front (fcfs) or
        # to their place by priority.
        self.waiting = make_request_queue(config.scheduling_policy, self.priority_key)
        self.running: list[Request] = []  # in admission order
        self._finished_request_ids: list[str] = []
        self.spec_decode_stats = SpecDecodeStats()  # verified drafts since start
        # Of those, (accepted tokens, rejections) by whether their request decodes greedily:
        # the prior of each request's acceptance estimate, apart per kind. A greedy request
        # accepts a draft that is the target's argmax, a sampled one with the target's
        # probability of it (a draft model's 0.98 against ~0.5 here); one prior from both
        # started a benchmark's greedy requests, after a sampled warm-up, at ~0.6: they drafted
        # 1-2 tokens where 3 paid, and at batch 8 the guard judged drafting by those steps.
        self.verified_by_kind: dict[bool, tuple[int, int]] = {}
        # Adaptive speculation: measured tokens/s with and without drafts, per batch size (the
        # engine reports each decode step's time), and the seconds already spent guessing the
        # drafts the next step may verify (a draft model's forwards: spent whether or not they
        # are verified, so they count in the time of every choice).
        self.speculation_guard = SpeculationGuard(min_gain=MIN_SPECULATION_GAIN)
        self.proposal_seconds = 0.0
        # Async scheduling: requests whose in-flight token reaches max_tokens or max_model_len,
        # so they end when it lands and are not scheduled again.
        self._ending_in_flight: set[str] = set()
        # Disaggregation. Decode side: requests whose prompt KV is being pulled (they hold
        # blocks and a seat). Both sides: blocks taken from finished requests but not freed
        # yet, by request id: a prefill instance's prompts waiting to be pulled, and the blocks
        # of a request aborted while a transfer still writes them.
        self.receiving: dict[str, Request] = {}
        self.detached: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """Requests a step could work on: all unfinished ones but those waiting for their KV."""
        return len(self.requests) > len(self.receiving)

    @property
    def num_seated(self) -> int:
        """Requests holding a seat of max_num_seqs: running, or receiving their KV."""
        return len(self.running) + len(self.receiving)

    def stop_status(self, request: Request) -> RequestStatus | None:
        """Whether the request ends at its last output token (a decode instance checks the
        first token, sampled by the prefill instance, before scheduling anything)."""
        return self._stop_status(
            request, request.all_token_ids[-1], request.num_output_tokens, request.num_tokens
        )

    def finish_kv_load(self, request_id: str, ok: bool) -> Request | None:
        """A pull of prompt KV has ended. Arrived: the request decodes from the next step on,
        its prompt blocks in the prefix cache. Failed: it computes its prompt here, from its
        local prefix-cache hits. A request aborted meanwhile gets its blocks freed now, as no
        transfer writes them any more. Returns the request unless it was aborted."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            self.release_detached(request_id)
            return None
        remote = request.remote_prefill
        assert remote is not None
        request.remote_prefill = None
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens
            request.num_cached_tokens = remote.num_cached_tokens
            self.kv_cache_manager.cache_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def release_detached(self, request_id: str) -> None:
        blocks = self.detached.pop(request_id, None)
        if blocks is not None:
            self.kv_cache_manager.release(blocks)

    def priority_key(self, request: Request) -> tuple[int, float, int]:
        """Priority order (smaller first): priority value, arrival time, add_request order."""
        return request.priority, request.arrival_time, self._arrival_order[request.request_id]

    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError for one that could never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} has already been scheduled")
        if request.priority and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"request {request.request_id!r} has priority {request.priority}, but priority "
                "scheduling is off: pass scheduling_policy='priority' (or leave priority at 0)"
            )
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens is longer than max_model_len="
                f"{self.config.max_model_len}"
            )
        kv = self.kv_cache_manager
        if num_prompt_tokens > kv.max_num_tokens:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens does not fit in the KV cache "
                f"({kv.num_blocks} blocks of {kv.block_size} tokens = {kv.max_num_tokens})"
            )
        params = request.sampling_params
        stop_ids = set(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(request.eos_token_id)
        request.stop_check_ids = frozenset(stop_ids)
        request.length_limit = self.max_model_len
        if params.max_tokens is not None:
            request.length_limit = min(self.max_model_len, num_prompt_tokens + params.max_tokens)
        self.requests[request.request_id] = request
        self._arrival_order[request.request_id] = next(self._next_arrival)
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Call update_from_output with its results before scheduling again."""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        if self.config.batching_policy == "decode-first":
            self._schedule_decode_first(plan)
        else:
            self._schedule_prefill_first(plan)
        return self._build_output(plan)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Sequence[int | Sequence[int]],
        logprobs_by_id: Mapping[str, list[dict[int, Logprob]]] | None = None,
    ) -> StepUpdate:
        """Record a step's results: progress, sampled tokens, stops. `sampled_token_ids`: for
        each entry of the step that samples, in order, its token, or its tokens (accepted
        drafts and one more, or a multi-step burst's), as the model runner lists them: no
        lookup by request id, no list per token in the common case. `logprobs_by_id`: the
        logprob rows of the requests that asked, one per token they got. Returns each request
        that got tokens with its output (those that finished have their status set and blocks
        freed)."""
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        updated: list[Request] = []
        finished: list[int] = []
        any_finished = False
        kv = self.kv_cache_manager
        caching, block_size = kv.enable_caching, kv.block_size
        running = RequestStatus.RUNNING
        stop_status = self._stop_status
        num_steps = scheduler_output.num_steps
        sampled = iter(sampled_token_ids)
        for scheduled, request in zip(
            scheduler_output.scheduled, scheduler_output.requests, strict=True
        ):
            if not scheduled.sample:
                if request.status is running:
                    request.num_computed_tokens += scheduled.num_new_tokens
                    kv.cache_blocks(request)
                continue
            token_ids = next(sampled, None)
            if token_ids is None:
                raise ValueError(
                    f"no sampled token for request {scheduled.request_id!r}: give one per "
                    "sampling entry of the step, in order"
                )
            if request.status is not running:
                continue  # aborted after it was scheduled
            if request.first_token_time is None:
                request.first_token_time = now
            num_drafts = len(scheduled.draft_token_ids)
            if isinstance(token_ids, int):
                token_id, num_got = token_ids, 1
            else:
                num_got = len(token_ids)
                if not 0 < num_got <= num_drafts + num_steps:
                    raise ValueError(
                        f"request {scheduled.request_id!r} got {num_got} tokens from a step "
                        f"that verified {num_drafts} drafts in {num_steps} forwards"
                    )
                token_id = token_ids[0]
            if num_drafts:
                self._record_verification(request, num_drafts, num_got - 1)
            num_computed_before = request.num_computed_tokens
            output_ids = request.output_token_ids
            if num_got > 1:  # accepted drafts, or a multi-step burst's tokens
                num_outputs_before = len(output_ids)
                finished_status = self._append_until_stop(request, token_ids, now)
            else:  # the common case, inline
                all_token_ids = request.all_token_ids
                output_ids.append(token_id)
                all_token_ids.append(token_id)
                request.last_token_time = now
                num_tokens = len(all_token_ids)
                num_outputs_before = -1  # (its one token: the last)
                # _stop_status ends a request only at one of these tokens or at this length.
                if token_id in request.stop_check_ids or num_tokens >= request.length_limit:
                    finished_status = stop_status(request, token_id, len(output_ids), num_tokens)
                else:
                    finished_status = None
            # Every appended token but the last was computed this step (an accepted draft);
            # rejected drafts' KV is dropped by moving back, and blocks holding only them go.
            num_computed = request.num_computed_tokens = len(request.all_token_ids) - 1
            if caching and num_computed // block_size > num_computed_before // block_size:
                kv.cache_blocks(request)  # a block filled up
            updated.append(request)
            if finished_status is not None:
                self._finish(request, finished_status, now)
                any_finished = True
                finished.append(len(outputs))
            elif num_drafts or request.spec_token_ids or num_got < num_steps:
                # Blocks past its tokens: rejected drafts', a proposer's unverified ones, or
                # those of a burst that another request's stop token ended early.
                kv.free_tail(request, request.num_tokens)
            if num_got == 1 and finished_status is None and not logprobs_by_id:
                # The common case: core_output's fields, in line.
                output = EngineCoreOutput(
                    request.request_id, [token_id], None, None, request.stop_reason,
                    request.num_cached_tokens, request.num_preemptions,
                    request.first_scheduled_time, request.first_token_time, now,
                    request.finished_time, None, request.num_draft_tokens,
                    request.num_accepted_tokens,
                )  # fmt: skip
                outputs.append(output)
            else:
                rows = logprobs_by_id.get(request.request_id) if logprobs_by_id else None
                outputs.append(core_output(request, num_outputs_before, None, rows))
        if next(sampled, None) is not None:
            raise ValueError("more sampled tokens than the step has sampling entries")
        if any_finished:
            self.running = [r for r in self.running if r.status is running]
        return StepUpdate(outputs, updated, finished)

    def mark_in_flight(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: count a step as done before its results are known, so the next
        step can be scheduled while it runs. Its tokens count as computed, and each sampling
        request gets a placeholder output token (the runner fills in its id on the device
        when the next step reads it); settle_in_flight writes the real ids."""
        if scheduler_output.num_draft_tokens or scheduler_output.num_steps > 1:
            raise ValueError(
                "a step verifying drafts or running several forwards cannot run in flight: its "
                "tokens decide"
            )
        max_model_len = self.max_model_len
        for scheduled, request in zip(
            scheduler_output.scheduled, scheduler_output.requests, strict=True
        ):
            request.num_computed_tokens += scheduled.num_new_tokens
            if not scheduled.sample:
                continue
            request.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
            request.all_token_ids.append(PLACEHOLDER_TOKEN_ID)
            max_tokens = request.sampling_params.max_tokens
            if len(request.all_token_ids) >= max_model_len or (
                max_tokens is not None and len(request.output_token_ids) >= max_tokens
            ):
                self._ending_in_flight.add(request.request_id)

    def settle_in_flight(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        logprobs_by_id: Mapping[str, list[dict[int, Logprob]]] | None = None,
    ) -> StepUpdate:
        """Record a step that ran in flight (mark_in_flight): its placeholders get their token
        ids (one per sampling entry, in order, as in update_from_output), and stops apply
        exactly as there. A request that stops drops the placeholder the next step gave it;
        one preempted meanwhile keeps its token (it recomputes it). Returns each request that
        got a token with its output, as update_from_output."""
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        updated: list[Request] = []
        finished: list[int] = []
        any_finished = False
        kv = self.kv_cache_manager
        sampled = iter(sampled_token_ids)
        for scheduled, request in zip(
            scheduler_output.scheduled, scheduler_output.requests, strict=True
        ):
            token_id = next(sampled, None) if scheduled.sample else None
            if request.is_finished:
                continue  # aborted after it was scheduled (its id may be a new request's now)
            running = request.status is RequestStatus.RUNNING
            num_computed = scheduled.num_computed_tokens + scheduled.num_new_tokens
            if not scheduled.sample:
                if running:
                    kv.cache_blocks(request, num_computed)
                continue
            if token_id is None:
                raise ValueError(
                    f"no sampled token for request {scheduled.request_id!r}: give one per "
                    "sampling entry of the step, in order"
                )
            position = num_computed  # the placeholder's index in all_token_ids
            num_output_tokens = position - request.num_prompt_tokens + 1
            request.all_token_ids[position] = token_id
            request.output_token_ids[num_output_tokens - 1] = token_id
            request.last_token_time = now
            if request.first_token_time is None:
                request.first_token_time = now
            updated.append(request)
            finished_status = self._stop_status(request, token_id, num_output_tokens, position + 1)
            if finished_status is None:
                if running:
                    kv.cache_blocks(request, num_computed)
            else:
                del request.all_token_ids[position + 1 :]
                del request.output_token_ids[num_output_tokens:]
                self._finish(request, finished_status, now)
                any_finished = True
                finished.append(len(outputs))
            rows = logprobs_by_id.get(request.request_id) if logprobs_by_id else None
            # Its token alone: the next step's placeholder may follow it.
            outputs.append(core_output(request, num_output_tokens - 1, num_output_tokens, rows))
        if next(sampled, None) is not None:
            raise ValueError("more sampled tokens than the step has sampling entries")
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
            self.waiting.discard_finished()
        return StepUpdate(outputs, updated, finished)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (aborts, stop strings); unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        to_finish = [self.requests[i] for i in ids if i in self.requests]
        if not to_finish:
            return
        now = self.clock()
        for request in to_finish:
            while request.output_token_ids and request.all_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                request.output_token_ids.pop()  # a token in flight that will never land
                request.all_token_ids.pop()
            self._finish(request, status, now)
        self.running = [r for r in self.running if not r.is_finished]
        self.waiting.discard_finished()

    # -- policies ------------------------------------------------------------------------------

    def _schedule_decode_first(self, plan: _StepPlan) -> None:
        # 1. every decoding request its token, 2. in-flight prompts their chunks;
        limit = self.config.long_prefill_token_limit
        if self._schedule_running_requests(plan, True, limit):
            self._schedule_running_requests(plan, False, limit, True)
        if plan.preempted:
            return  # blocks are short: admitting more (or drafts) would only preempt again
        # 3. new (and preempted) requests, in queue order.
        if not self.waiting:
            self._schedule_drafts(plan)
            self._schedule_steps(plan)
            return
        num_partial = sum(
            1
            for r in self.running
            if r.num_computed_tokens + plan.num_new_tokens_of(r) < r.num_prompt_tokens
        )
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0:
            if self.num_seated >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.remote_prefill is not None:
                if not self._start_kv_load(request, plan):
                    break
                continue
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_remaining = request.num_tokens - num_cached_tokens
            num_new_tokens = self._within_target(
                plan,
                num_cached_tokens,
                num_remaining,
                min(num_remaining, plan.token_budget, self.config.long_prefill_token_limit),
            )
            if num_new_tokens == 0:
                break  # the step is as long as the ITL target allows
            if num_new_tokens < num_remaining and not self.config.enable_chunked_prefill:
                break  # a whole prompt or nothing: it waits for a step with room (as vLLM)
            stays_partial = num_cached_tokens + num_new_tokens < request.num_prompt_tokens
            if stays_partial and num_partial >= self.config.max_num_partial_prefills:
                # Too many prompts mid-prefill; a shorter one behind may still finish in a step.
                skipped.append(self.waiting.pop())
                continue
            if not self._admit(request, computed_blocks, num_cached_tokens, num_new_tokens, plan):
                break
            num_partial += stays_partial
        self.waiting.prepend(skipped)
        # 4. drafts last: optional work, in what the budget, blocks and ITL target leave.
        self._schedule_drafts(plan)

    def _schedule_prefill_first(self, plan: _StepPlan) -> None:
        # Prompts longer than the budget are chunked; continue those first.
        limit = self.config.max_num_batched_tokens
        self._schedule_running_requests(plan, False, limit)
        if not plan.preempted:
            self._admit_whole_prompts(plan)
        if not plan.entries:  # otherwise a prefill step: never mixed with decodes
            self._schedule_running_requests(plan, None, limit)
            if not plan.preempted:
                self._schedule_drafts(plan)
                self._schedule_steps(plan)

    def _admit_whole_prompts(self, plan: _StepPlan) -> None:
        while self.waiting and plan.token_budget > 0:
            if self.num_seated >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            if request.remote_prefill is not None:
                if not self._start_kv_load(request, plan):
                    break
                continue
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached_tokens
            if num_new_tokens > plan.token_budget:
                fits_whole = num_new_tokens <= self.config.max_num_batched_tokens
                if fits_whole or not self.config.enable_chunked_prefill:
                    break  # fits whole in the next step
                num_new_tokens = plan.token_budget  # could never fit whole: chunk it
            if not self._admit(request, computed_blocks, num_cached_tokens, num_new_tokens, plan):
                break

    # -- mechanics ------------------------------------------------------------------------------

    def _schedule_running_requests(
        self,
        plan: _StepPlan,
        decoding: bool | None,
        max_tokens_each: int,
        prompt_chunks: bool = False,
    ) -> int:
        """Schedule the running requests that are decoding (`decoding` True), still in their
        prompt (False) or either (None), oldest first, while the budget lasts; `prompt_chunks`:
        they are prompts, sized against the ITL target if there is one. Decodes whose blocks
        hold their token, or will with one more block from the pool, the common case, are
        gathered and planned in one go, their entries of the step built here.
        Returns how many running requests it passed over for being in the other phase (with
        none, a pass over the other phase has nothing to do)."""
        ending = self._ending_in_flight
        kv = self.kv_cache_manager
        held_block_ids, block_size = kv.held_block_ids, kv.block_size
        running = RequestStatus.RUNNING
        # Gathered, not planned yet: as plan.entries' items.
        decodes: dict[str, tuple[Request, int, ScheduledRequest | None]] = {}
        num_context = 0
        budget = plan.token_budget
        num_other_phase = 0
        for request in list(self.running):
            if budget == 0:
                break
            if ending and request.request_id in ending:
                continue  # its token in flight ends it
            num_computed = request.num_computed_tokens
            if request.status is not running:
                continue
            is_decoding = num_computed >= request.num_prompt_tokens
            if decoding is not None and is_decoding != decoding:
                num_other_phase += 1
                continue
            token_ids = request.all_token_ids
            num_uncomputed = len(token_ids) - num_computed
            if num_uncomputed == 1 and not prompt_chunks:
                request_id = request.request_id
                blocks = held_block_ids.get(request_id)
                # Its blocks hold its token, or one more block will (a block filled up): it takes
                # that block here; with none free it goes the general way (preemption).
                if blocks is not None and (
                    num_computed < len(blocks) * block_size
                    or (
                        num_computed < (len(blocks) + 1) * block_size
                        and kv.allocate_slots(request, 1) is not None
                    )
                ):
                    entry = None  # a prompt's last token: _build_output files it as prefill
                    if is_decoding:
                        entry = ScheduledRequest(
                            request_id, token_ids, num_computed, 1, blocks, True, _NO_DRAFTS
                        )
                    decodes[request_id] = (request, 1, entry)
                    num_context += num_computed + 1
                    budget -= 1
                    continue
            plan.add_decodes(decodes, num_context)
            decodes, num_context = {}, 0
            num_new_tokens = min(num_uncomputed, plan.token_budget, max_tokens_each)
            if prompt_chunks:
                num_new_tokens = self._within_target(
                    plan, num_computed, num_uncomputed, num_new_tokens
                )
                if num_new_tokens == 0:
                    return num_other_phase
            self._schedule_running(request, num_new_tokens, plan)
            budget = plan.token_budget
        plan.add_decodes(decodes, num_context)
        return num_other_phase

    def _planning_target(self) -> float | None:
        """The ITL target less the cost model's headroom: what a step is planned within."""
        target = self.config.target_step_time
        if target is None:
            return None
        assert self.cost_model is not None
        return target / (1 + self.cost_model.headroom)

    def _within_target(
        self, plan: _StepPlan, num_computed: int, num_remaining: int, num_tokens: int
    ) -> int:
        """The most of `num_tokens` prompt tokens (of `num_remaining` left, `num_computed`
        before them) the step can take with its predicted time within the ITL target; all
        of them without a target. The prediction grows with the chunk, so a bisection finds
        it; it is held within the target less the cost model's headroom (its recent over-runs
        on such steps), and the chunk to what fills the step to twice the most tokens the
        model has seen (but at least MIN_PREFILL_TOKENS). Prompts always progress: where no
        token fits, the step's first chunk still gets as many of MIN_PREFILL_TOKENS as keep
        the step within the target itself (its headroom aside), at least one; all of them
        where the step's decodes alone already pass the target, which then cannot be met
        anyway. (A fixed forced chunk overran targets the decodes left room for: in fp32, 16
        prompt tokens beside 8 decodes made the streams' worst gaps, 1.4-1.7x the target.)
        A step that samples no token so far (no decodes, no prompt finishing) keeps nobody
        waiting for its end: its prompts take all they may (a lone 1,536-token prompt had gone
        on in chunks of 16-28 tokens once the streams ended); a prompt's last chunk makes the
        step produce its first token, and the target holds for the chunks after it."""
        target = self._planning_target()
        if target is None or num_tokens == 0:
            return num_tokens
        if plan.num_sampled == 0:
            plan.has_prefill = True  # the step's prompts progress: no forced chunk after it
            return num_tokens
        assert self.cost_model is not None
        cost_model = self.cost_model
        trusted = 2 * max(cost_model.max_observed_tokens, MIN_PREFILL_TOKENS)
        num_tokens = min(num_tokens, max(trusted - plan.num_new_tokens, MIN_PREFILL_TOKENS))

        def most_within(limit: float, most: int) -> int:
            """The most of `most` tokens whose step is predicted within `limit` (0: none)."""

            def fits(num_new: int) -> bool:
                sums = request_sums(num_computed, num_new, num_new == num_remaining)
                return cost_model.predict(plan.sums + sums) <= limit

            if fits(most):
                return most
            low, high = 0, most  # fits(low) or low == 0; never fits(high)
            while high - low > 1:
                middle = (low + high) // 2
                if fits(middle):
                    low = middle
                else:
                    high = middle
            return low

        chosen = most_within(target, num_tokens)
        if chosen == 0 and not plan.has_prefill:
            forced = min(num_tokens, MIN_PREFILL_TOKENS)
            limit = self.config.target_step_time
            if cost_model.predict(plan.sums) <= limit:
                forced = max(1, most_within(limit, forced))
            chosen = forced
        plan.has_prefill = plan.has_prefill or chosen > 0
        return chosen

    def _schedule_drafts(self, plan: _StepPlan) -> None:
        """Give the planned decodes draft tokens to verify: as many as the proposer found
        (within the budget left, the request's max_tokens and max_model_len) or, adaptive,
        the number that maximizes the step's expected emitted tokens per predicted second.
        Drafts never preempt: a request whose blocks cannot grow verifies none. Only a request
        decoding its one last token takes drafts (one resuming after a preemption has more
        to recompute first)."""
        config = self.config
        if config.num_speculative_tokens == 0:
            return
        num_decodes = _num_decodes(plan)
        if num_decodes == 0:
            return
        adaptive = config.adaptive_speculation and self.cost_model is not None
        # Asked every decode step, drafts or not, so its exploring steps come round.
        if adaptive and not self.speculation_guard.allows(
            num_decodes, all_greedy(request for request, _, _ in plan.entries.values())
        ):
            return
        limit = config.speculation_max_running
        if plan.token_budget == 0 or (limit is not None and len(self.running) >= limit):
            return
        candidates = [
            (request, self._draft_limit(request))
            for request, num_new_tokens, _ in plan.entries.values()
            if request.spec_token_ids and num_new_tokens == 1 == request.num_uncomputed_tokens
        ]
        candidates = [(request, limit) for request, limit in candidates if limit > 0]
        if not candidates:
            return
        if adaptive:
            acceptance = 1.0 if self.speculation_guard.probing else None
            counts = self._choose_drafts(
                plan, candidates, self.proposal_seconds, sunk=True, acceptance=acceptance
            )
        else:
            counts = [limit for _, limit in candidates]
        for (request, _), num_drafts in zip(candidates, counts, strict=True):
            num_drafts = min(num_drafts, plan.token_budget)
            if num_drafts == 0:
                # Not drafting: let its acceptance estimate drift back to the engine's.
                request.recent_accepted *= ACCEPTANCE_DECAY
                request.recent_rejections *= ACCEPTANCE_DECAY
                continue
            if self.kv_cache_manager.allocate_slots(request, 1 + num_drafts) is not None:
                plan.add(request, 1 + num_drafts, num_drafts)

    def _schedule_steps(self, plan: _StepPlan) -> None:
        """Multi-step scheduling (vLLM v0's num_scheduler_steps): a step whose only work is
        the next token of every running request (up to multi_step_max_seqs of them), each
        sampled plainly (greedy or random, nothing reported or processed), with no drafts to
        verify, runs several forwards, each fed the tokens the one before chose, so the
        engine's per-step work (scheduling, input preparation, outputs, telemetry: ~7% of a
        small model's batch-1 step on a CPU) is paid once per burst. As many as
        num_scheduler_steps, the requests' length limits and MULTI_STEP_WINDOW (or the ITL
        target) allow by the step-cost model's forecast; the burst's blocks are allocated
        here. Not while any request waits for a seat or its KV (it would wait for the burst),
        and not for a request's first token (its time to first token stays one forward)."""
        max_steps = self.config.num_scheduler_steps
        entries = plan.entries
        if max_steps == 1 or plan.drafts or not 0 < len(entries) <= self.config.multi_step_max_seqs:
            return
        if len(self.running) != len(entries) or self.waiting or self.receiving:
            return  # (a running request the budget left out would wait for the burst too)
        # The window first: a step as long as the window (a large batch) looks at no request.
        target = self._planning_target()
        window = MULTI_STEP_WINDOW if target is None else min(MULTI_STEP_WINDOW, target)
        forecast = 0.0 if self.cost_model is None else self.cost_model.predict(plan.sums)
        if forecast > 0:  # none, or a line fitted to nonsense: the burst knows no window
            max_steps = min(max_steps, int(window / forecast))
        requests = []
        for request, num_new_tokens, _ in entries.values():
            if max_steps <= 1 or not (
                num_new_tokens == 1 == request.num_uncomputed_tokens
                and request.plain_sampling
                and request.num_output_tokens >= max(1, request.sampling_params.min_tokens)
            ):
                return
            max_steps = min(max_steps, request.length_limit - request.num_tokens)
            requests.append(request)
        if max_steps <= 1:
            return
        kv = self.kv_cache_manager
        for index, request in enumerate(requests):
            if kv.allocate_slots(request, max_steps) is None:
                for allocated in requests[:index]:  # back to this step's one token each
                    kv.free_tail(allocated, allocated.num_tokens)
                    # A new, shorter table: the entry built with the old one is built again.
                    entries[allocated.request_id] = (allocated, 1, None)
                return
        plan.num_steps = max_steps

    def _draft_limit(self, request: Request) -> int:
        return min(len(request.spec_token_ids), self.max_drafts(request))

    def max_drafts(self, request: Request) -> int:
        """The most drafts the request may verify next: the configured number, within
        max_model_len and max_tokens (the step emits one token more than it accepts)."""
        num_drafts = min(
            self.config.num_speculative_tokens, self.max_model_len - request.num_tokens
        )
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            num_drafts = min(num_drafts, max_tokens - request.num_output_tokens - 1)
        return max(num_drafts, 0)

    def drafts_may_pay(self, requests: list[Request], limits: list[int], seconds: float) -> bool:
        """Whether drafts could pay in the requests' next decode step if each had `limit` of
        them and guessing them cost `seconds`: whether the step would verify any
        (_choose_drafts) were every draft accepted. A costly proposer (a draft model) asks
        before it guesses, by its forecast cost. (Not by the acceptance estimates: a request's
        moves only with drafts verified, so an estimate low from the start, e.g. one made
        from sampled requests' drafts for greedy ones, would never be tested again; which
        drafts are worth verifying is the step's own choice, the measured guard's check.)"""
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens)
        decodes = {request.request_id: (request, 1, None) for request in requests}  # (no step's)
        plan.add_decodes(decodes, sum(request.num_tokens for request in requests))
        candidates = [(r, limit) for r, limit in zip(requests, limits, strict=True) if limit > 0]
        return any(self._choose_drafts(plan, candidates, seconds, sunk=False, acceptance=1.0))

    def _choose_drafts(
        self,
        plan: _StepPlan,
        candidates: list[tuple[Request, int]],
        spent: float,
        sunk: bool,
        acceptance: float | None = None,
    ) -> list[int]:
        """Drafts per candidate that maximize the expected value of the step's tokens over its
        predicted time plus `spent`, the seconds guessing them costs (`sunk`: already paid, so
        verifying none costs it too). The i-th draft of a request is emitted with chance
        acceptance^i (`acceptance`, or the request's estimate), and a token is worth its
        request's weight (`_token_weights`); drafts are added in order of their value, and
        the best of those prefixes wins if it beats verifying none by MIN_SPECULATION_GAIN
        (the step-cost model may jump, e.g. at a CUDA graph size, so a longer prefix can win
        again). Drafts never push a step past the packed weights' size, though: there a CPU
        step leaves the fused decode path for the layer-by-layer one on dense weights, a cost
        the model learns only from such steps, each worth many plain ones (BENCHMARKS.md,
        issue 12)."""
        assert self.cost_model is not None
        weights = self._token_weights([request for request, _, _ in plan.entries.values()])
        increments = []
        for index, (request, limit) in enumerate(candidates):
            chance = self._acceptance(request) if acceptance is None else acceptance
            value = weights.get(request.request_id, 1.0)
            for position in range(1, limit + 1):
                value *= chance
                increments.append((-value, index, position))
        increments.sort()
        sums = plan.sums
        expected = sum(  # the tokens the step emits without drafts, weighted
            weights.get(request.request_id, 1.0)
            for request, num_new_tokens, _ in plan.entries.values()
            if request.num_computed_tokens + num_new_tokens == request.num_tokens
        )
        base_rate = expected / max(self.cost_model.predict(sums) + sunk * spent, 1e-9)
        target = self._planning_target()
        best_rate = base_rate * (1 + MIN_SPECULATION_GAIN)
        best_length = 0
        counts = [0] * len(candidates)
        budget = plan.token_budget
        packed_limit = self.cost_model.packed_max_tokens
        if packed_limit > 0 and plan.sums.num_new_tokens <= packed_limit:
            budget = min(budget, packed_limit - plan.sums.num_new_tokens)
        for length, (negative_chance, index, position) in enumerate(increments, start=1):
            if length > budget:
                break
            request = candidates[index][0]
            before = request.num_computed_tokens
            grown = request_sums(before, 1 + position, True, position)
            sums = sums - request_sums(before, position, True, position - 1) + grown
            expected -= negative_chance
            predicted = self.cost_model.predict(sums)
            if target is not None and predicted > target:
                break  # drafts never push a step past the ITL target
            rate = expected / max(predicted + spent, 1e-9)
            if rate > best_rate:
                best_rate, best_length = rate, length
        for _, index, _ in increments[:best_length]:
            counts[index] += 1
        return counts

    def _token_weights(self, requests: list[Request]) -> dict[str, float]:
        """What a token of each request is worth to the run. With requests waiting, every
        token is (a request that finishes early frees its seat for them). With none waiting
        and every request's max_tokens known, only the requests with the most left shorten
        the run: a request's token is worth its tokens left over the most any has left, so
        requests already ahead stop spending step time on drafts that only make them finish
        early while the rest run on at a smaller, less efficient batch (a closed batch's
        makespan is its slowest request's)."""
        if self.waiting:
            return {}
        remaining = {}
        for request in requests:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is None:
                return {}
            remaining[request.request_id] = max_tokens - request.num_output_tokens
        most = max(remaining.values(), default=0)
        if most <= 0:
            return {}
        return {request_id: left / most for request_id, left in remaining.items()}

    def _acceptance(self, request: Request) -> float:
        """The chance that the request's next draft is accepted given the previous one was:
        accepted / (accepted + rejections), its recent counts blended with the engine's for
        requests of its kind (greedy or not)."""
        kind = request.sampling_params.is_greedy
        num_accepted, num_rejections = self.verified_by_kind.get(kind, (0, 0))
        overall = (num_accepted + 1) / (num_accepted + num_rejections + 2)
        accepted = request.recent_accepted + ACCEPTANCE_PRIOR_WEIGHT * overall
        return accepted / (request.recent_accepted + request.recent_rejections
                           + ACCEPTANCE_PRIOR_WEIGHT)  # fmt: skip

    def _record_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        request.recent_accepted = request.recent_accepted * ACCEPTANCE_DECAY + num_accepted
        rejected = num_accepted < num_drafts
        request.recent_rejections = request.recent_rejections * ACCEPTANCE_DECAY + rejected
        self.spec_decode_stats.record(num_drafts, num_accepted)
        kind = request.sampling_params.is_greedy
        total_accepted, total_rejections = self.verified_by_kind.get(kind, (0, 0))
        self.verified_by_kind[kind] = (total_accepted + num_accepted, total_rejections + rejected)

    def _schedule_running(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> None:
        """Give a running request blocks for its tokens, preempting running requests from the
        back of the queue order until they fit: the newest (fcfs), or the highest priority
        value, latest arrival (priority). It may be the request itself."""
        while self.kv_cache_manager.allocate_slots(request, num_new_tokens) is None:
            if self.config.scheduling_policy == "priority":
                victim = max(self.running, key=self.priority_key)
            else:
                victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return
        plan.add(request, num_new_tokens)

    def _admit(
        self,
        request: Request,
        computed_blocks: list[KVCacheBlock],
        num_cached_tokens: int,
        num_new_tokens: int,
        plan: _StepPlan,
    ) -> bool:
        """Start (or resume) a waiting request at the head of the queue. Refused unless all its
        remaining tokens fit in the free blocks now, so a resumed request is not preempted
        again at once (preempt/resume thrash)."""
        kv = self.kv_cache_manager
        if not kv.can_allocate(request, request.num_tokens, computed_blocks):
            return False
        new_block_ids = kv.allocate_slots(request, num_new_tokens, computed_blocks)
        assert new_block_ids is not None, "can_allocate has checked these blocks"
        self.waiting.pop()
        request.num_computed_tokens = num_cached_tokens  # num_cached_tokens: set by allocate_slots
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.add(request, num_new_tokens)
        plan.admitted.add(request.request_id)
        return True

    def _start_kv_load(self, request: Request, plan: _StepPlan) -> bool:
        """Give a request that arrives with its prompt computed elsewhere the blocks of its
        whole prompt and first token (which comes with it, or at the end of a stream), and
        plan the pull of the prompt blocks its local prefix-cache hits lack. Like any
        admission, refused unless they all fit now. It takes no token budget: it computes
        nothing until its KV is here."""
        kv = self.kv_cache_manager
        computed_blocks, num_cached_tokens = kv.get_computed_blocks(request)
        num_tokens = request.num_prompt_tokens + 1
        if not kv.can_allocate(request, num_tokens, computed_blocks):
            return False
        num_new_tokens = num_tokens - num_cached_tokens
        new_block_ids = kv.allocate_slots(request, num_new_tokens, computed_blocks)
        assert new_block_ids is not None, "can_allocate has checked these blocks"
        self.waiting.pop()
        request.num_computed_tokens = num_cached_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.receiving[request.request_id] = request
        first_block = num_cached_tokens // kv.block_size
        num_prompt_blocks = kv.blocks_needed(request.num_prompt_tokens)
        block_ids = kv.get_block_ids(request.request_id)[first_block:num_prompt_blocks]
        assert request.remote_prefill is not None
        load = KVLoad(
            request.request_id, request.remote_prefill, first_block, list(block_ids),
            request.prompt_token_ids,
        )  # fmt: skip
        plan.kv_loads.append(load)
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Free the request's KV and send it back to the queue (fcfs: to the front) to recompute
        later. Its output tokens are kept; it samples again once it has caught up with them."""
        self.running.remove(request)
        plan.drop(request)
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.spec_token_ids = ()  # it must recompute first; guesses come again after
        self.waiting.prepend([request])
        plan.preempted.append(request)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Mark finished and free its blocks (detach them, where a decode instance will pull
        them or a transfer still writes them); the caller removes it from running/waiting."""
        request_id = request.request_id
        kv = self.kv_cache_manager
        receiving = self.receiving.pop(request_id, None) is not None
        if receiving or (request.hold_kv and status is not RequestStatus.FINISHED_ABORTED):
            self.detached[request_id] = kv.detach(request)
        else:
            kv.free(request)
        request.status = status
        request.finished_time = now
        del self.requests[request_id]
        del self._arrival_order[request_id]
        self._ending_in_flight.discard(request_id)
        self._finished_request_ids.append(request_id)

    def _append_until_stop(
        self, request: Request, token_ids: list[int], now: float
    ) -> RequestStatus | None:
        """Append sampled tokens one by one (several with speculative decoding or a multi-step
        burst) and stop at the first one that ends the request; the rest are dropped."""
        for token_id in token_ids:
            request.append_output_token_ids([token_id])
            request.last_token_time = now
            status = self._stop_status(
                request, token_id, request.num_output_tokens, request.num_tokens
            )
            if status is not None:
                return status
        return None

    def _stop_status(
        self, request: Request, token_id: int, num_output_tokens: int, num_tokens: int
    ) -> RequestStatus | None:
        """Whether the request ends at `token_id`, its `num_output_tokens`-th output token and
        `num_tokens`-th token (setting its stop_reason for a stop token id)."""
        params = request.sampling_params
        if num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if num_tokens >= self.max_model_len or (
            max_tokens is not None and num_output_tokens >= max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        now = self.clock()
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        decode_requests: list[Request] = []
        prefill_requests: list[Request] = []
        num_decode_tokens = 0
        held_block_ids = self.kv_cache_manager.held_block_ids
        drafts, admitted = plan.drafts, plan.admitted
        for request, num_new_tokens, built in plan.entries.values():
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if built is not None:  # a decode, planned with its entry
                decodes.append(built)
                decode_requests.append(request)
                num_decode_tokens += 1
                continue
            request_id = request.request_id
            num_computed = request.num_computed_tokens
            num_drafts = drafts.get(request_id, 0) if drafts else 0
            token_ids = request.all_token_ids
            block_ids = held_block_ids.get(request_id)
            scheduled = ScheduledRequest(
                request_id,
                token_ids,
                num_computed,
                num_new_tokens,
                [] if block_ids is None else block_ids,
                num_computed + num_new_tokens - num_drafts == len(token_ids),
                list(request.spec_token_ids[:num_drafts]) if num_drafts else _NO_DRAFTS,
            )
            assert not num_drafts or scheduled.sample, "drafts follow a request's last token"
            # A request (re)admitted this step is catching up even if its prompt was a cache hit.
            prefill_done = num_computed >= request.num_prompt_tokens
            if prefill_done and (not admitted or request_id not in admitted):
                decodes.append(scheduled)
                decode_requests.append(request)
                num_decode_tokens += num_new_tokens
            else:
                prefills.append(scheduled)
                prefill_requests.append(request)
        total = self.config.max_num_batched_tokens - plan.token_budget
        finished_ids, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(
            scheduled=decodes + prefills,
            requests=decode_requests + prefill_requests,
            total_num_scheduled_tokens=total,
            num_prefill_tokens=total - num_decode_tokens,
            num_decode_tokens=num_decode_tokens,
            preempted_request_ids=[r.request_id for r in plan.preempted],
            finished_request_ids=finished_ids,
            sums=plan.sums,
            num_draft_tokens=sum(plan.drafts.values()),
            num_steps=plan.num_steps,
            kv_loads=plan.kv_loads,
        )
