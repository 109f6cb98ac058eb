"""The scheduler driven by a fake model over random workloads, checking the invariants of
DESIGN.md after every step: caps, decode-first order, block ownership, KV contents, progress,
and vLLM's queue order (fcfs / priority) for admission and preemption."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import StepUpdate, core_output
from tandem.core.roofline import batch_sums
from tandem.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tandem.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from tandem.sampling_params import SamplingParams

from helpers import in_order

EOS = 2
SHARED_PREFIXES = ([7] * 24, list(range(3, 27)))  # so prefix caching gets hits


def model_token(context: list[int]) -> int:
    """Deterministic next token of a context: EOS now and then, otherwise a small id that
    stop_token_ids can name."""
    digest = 0
    for token_id in context:
        digest = (digest * 1_000_003 + token_id) % 2_147_483_647
    return EOS if digest % 13 == 0 else 3 + digest % 24


class FakeModelRunner:
    """Writes every computed token into its KV slot and, before computing a request's new
    tokens, reads its whole context back from the cache: a wrong block table, a block reused
    while still held, or a bad prefix-cache hit shows up as a mismatch."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.slots: dict[int, int] = {}

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        if output.num_steps > 1:
            return self._decode_steps(output)
        block_size = self.kv.block_size
        written: set[int] = set()
        sampled: dict[str, list[int]] = {}
        for scheduled in output.scheduled:
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            block_ids = scheduled.block_ids
            assert len(block_ids) >= self.kv.blocks_needed(end)
            assert end <= len(scheduled.token_ids)
            for position in range(start):
                slot = block_ids[position // block_size] * block_size + position % block_size
                assert self.slots.get(slot) == scheduled.token_ids[position], "stale KV"
            for position in range(start, end):
                block_id = block_ids[position // block_size]
                assert self.kv.block_pool.blocks[block_id].ref_cnt == 1, "wrote a shared block"
                slot = block_id * block_size + position % block_size
                assert slot not in written, "two requests wrote one slot"
                written.add(slot)
                self.slots[slot] = scheduled.token_ids[position]
            if scheduled.sample:
                sampled[scheduled.request_id] = [model_token(scheduled.token_ids[:end])]
        return sampled

    def _decode_steps(self, output: SchedulerOutput) -> dict[str, list[int]]:
        """Multi-step scheduling: the requests' forwards, each row fed the token it chose the
        step before, until a step where a row's token may end it (as the C loop: its stop
        ids)."""
        assert all(s.num_new_tokens == 1 and s.sample for s in output.scheduled)
        assert all(r.plain_sampling for r in output.requests)
        contexts = [list(s.token_ids) for s in output.scheduled]
        tokens: dict[str, list[int]] = {s.request_id: [] for s in output.scheduled}
        for _ in range(output.num_steps):
            entries = []
            for scheduled, context in zip(output.scheduled, contexts, strict=True):
                entry = copy.copy(scheduled)  # a record: a msgspec Struct or a dataclass
                entry.token_ids, entry.num_computed_tokens = context, len(context) - 1
                entries.append(entry)
            sampled = self.execute(dataclasses.replace(output, scheduled=entries, num_steps=1))
            stopped = False
            for scheduled, request, context in zip(
                output.scheduled, output.requests, contexts, strict=True
            ):
                (token,) = sampled[scheduled.request_id]
                tokens[scheduled.request_id].append(token)
                context.append(token)
                stopped |= token in request.stop_check_ids
            if stopped:
                break
        return tokens


@dataclass
class RequestSpec:
    arrival_step: int  # also its arrival_time: requests of one step tie, add order decides
    prompt_token_ids: list[int]
    params: SamplingParams
    abort_step: int | None
    abort_after_schedule: bool
    priority: int = 0


@dataclass
class Workload:
    config: SchedulerConfig
    num_blocks: int
    block_size: int
    enable_caching: bool
    requests: list[RequestSpec]
    # Requests sampled plainly (Request.plain_sampling): multi-step scheduling's.
    plain_sampling: list[bool] = dataclasses.field(default_factory=list)


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(2, 40 // block_size + 2))
    max_num_seqs = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(4, 48))
    chunked = draw(st.integers(0, 3)) > 0
    config = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(max(max_num_seqs, 0 if chunked else 48), 48)),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_partial_prefills=draw(st.integers(1, 3)),
        long_prefill_token_threshold=draw(st.integers(0, 12)) if chunked else 0,
        batching_policy=draw(st.sampled_from(["decode-first", "prefill-first"])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked,
        num_scheduler_steps=draw(st.sampled_from([1, 1, 3, 8])),
        multi_step_max_seqs=draw(st.sampled_from([1, 2, 6])),
    )
    priorities = st.integers(-2, 2) if config.scheduling_policy == "priority" else st.just(0)
    max_prompt_len = min(config.max_model_len, num_blocks * block_size)
    specs = []
    for _ in range(draw(st.integers(1, 10))):
        prompt_len = draw(st.integers(1, max_prompt_len))
        shared = draw(st.sampled_from(SHARED_PREFIXES))[: draw(st.integers(0, prompt_len))]
        tail = draw(
            st.lists(
                st.integers(3, 40),
                min_size=prompt_len - len(shared),
                max_size=prompt_len - len(shared),
            )
        )
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 12)))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 4)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(3, 26), max_size=2)),
        )
        aborted = draw(st.integers(0, 4)) == 0
        specs.append(
            RequestSpec(
                arrival_step=draw(st.integers(0, 12)),
                prompt_token_ids=shared + tail,
                params=params,
                abort_step=draw(st.integers(0, 30)) if aborted else None,
                abort_after_schedule=draw(st.booleans()),
                priority=draw(priorities),
            )
        )
    plain_sampling = [draw(st.integers(0, 3)) > 0 for _ in specs]
    return Workload(config, num_blocks, block_size, draw(st.booleans()), specs, plain_sampling)


def check_queue_order(
    scheduler: Scheduler,
    output: SchedulerOutput,
    queue_before: list[Request],
    running_before: list[Request],
) -> None:
    """Admission follows the queue order (fcfs: arrival, preempted first; priority: lowest
    value, then arrival), and preemption takes the back of that order first."""
    config = scheduler.config
    if config.scheduling_policy == "priority":
        keys = [scheduler.priority_key(r) for r in queue_before]
        assert keys == sorted(keys), "the priority queue is out of order"
    planned = {s.request_id: s.num_new_tokens for s in output.scheduled}
    admitted = [r.request_id for r in queue_before if r.request_id in planned]
    num_partial = sum(
        r.num_computed_tokens + planned.get(r.request_id, 0) < r.num_prompt_tokens
        for r in scheduler.running
    )
    # A waiting prompt that would stay mid-prefill may be passed over (decode-first's cap on
    # partial prefills); otherwise the admitted requests are the head of the queue.
    if config.batching_policy == "prefill-first" or num_partial < config.max_num_partial_prefills:
        assert admitted == [r.request_id for r in queue_before[: len(admitted)]], "queue jumped"
    victims = [r for r in running_before if r.request_id in output.preempted_request_ids]
    survivors = [r for r in running_before if r.status is RequestStatus.RUNNING]
    if victims and survivors:
        if config.scheduling_policy == "priority":
            rank = scheduler.priority_key
        else:
            position = {r.request_id: i for i, r in enumerate(running_before)}
            rank = lambda r: position[r.request_id]  # noqa: E731
        assert max(map(rank, survivors)) < min(map(rank, victims)), "preempted out of order"
    if not config.enable_chunked_prefill:
        assert all(s.sample for s in output.scheduled), "a prompt was chunked"


def check_step(
    scheduler: Scheduler,
    output: SchedulerOutput,
    waiting_before: set[str],
    decoding_before: set[str],
    prompt_lens: dict[str, int],
) -> None:
    config = scheduler.config
    assert len(output.scheduled) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    total = sum(s.num_new_tokens for s in output.scheduled)
    assert total == output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert output.num_prefill_tokens + output.num_decode_tokens == total
    assert all(s.num_new_tokens >= 1 for s in output.scheduled)
    assert len({s.request_id for s in output.scheduled}) == len(output.scheduled)
    is_decode = [
        s.num_computed_tokens >= prompt_lens[s.request_id] and s.request_id not in waiting_before
        for s in output.scheduled
    ]
    assert is_decode == sorted(is_decode, reverse=True), "a prompt chunk came before a decode"
    assert sum(s.num_new_tokens for s, d in zip(output.scheduled, is_decode, strict=True) if d) == (
        output.num_decode_tokens
    )
    admitted = {s.request_id for s in output.scheduled} & waiting_before
    if output.preempted_request_ids:
        assert not admitted, "admitted a request in a step that preempted"
    if config.batching_policy == "prefill-first":
        assert len(set(is_decode)) <= 1, "prefill-first mixed prefill and decode"
        return
    assert all(s.num_new_tokens <= config.long_prefill_token_limit for s in output.scheduled)
    scheduled = {s.request_id for s in output.scheduled}
    left_out = decoding_before - scheduled - set(output.preempted_request_ids)
    if left_out:
        assert output.num_prefill_tokens == 0, "a prompt chunk ran while a decode was left out"
    if admitted and total < config.max_num_batched_tokens:
        assert decoding_before <= scheduled, "admitted while a decode was left out"


def check_outputs(update: StepUpdate, num_outputs_before: dict[str, int] | None) -> None:
    """An output per request that got tokens, with the tokens it got (`num_outputs_before`:
    each request's output tokens before the step; None: a step that ran in flight, one token
    each), as core_output builds it (update_from_output builds the common case in line), and
    the finished ones listed."""
    assert [o.request_id for o in update.outputs] == [r.request_id for r in update.requests]
    assert update.finished == [i for i, r in enumerate(update.requests) if r.is_finished]
    for output, request in zip(update.outputs, update.requests, strict=True):
        if num_outputs_before is None:
            (token_id,) = output.new_token_ids
            assert token_id != PLACEHOLDER_TOKEN_ID
            start = len(request.output_token_ids) - 1
            if request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                start -= 1
            assert output == core_output(request, start, start + 1, None)
        else:
            start = num_outputs_before[request.request_id]
            assert output.new_token_ids and output == core_output(request, start, None, None)


def check_blocks(scheduler: Scheduler, all_requests: list[Request]) -> None:
    kv = scheduler.kv_cache_manager
    holders: dict[int, int] = {}
    for request in all_requests:
        block_ids = kv.get_block_ids(request.request_id)
        if request.status is not RequestStatus.RUNNING:
            assert block_ids == [], f"{request.status.name} request holds blocks"
        for block_id in block_ids:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in kv.block_pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0) >= 0
        assert (block in kv.block_pool.free_block_queue) == (block.ref_cnt == 0)
        if holders.get(block.block_id, 0) > 1:
            assert block.block_hash is not None, "an unhashed block is shared"
    assert kv.num_free_blocks == kv.num_blocks - len(holders)
    if scheduler.config.batching_policy == "decode-first":
        num_partial = sum(1 for r in scheduler.running if not r.is_prefill_done)
        assert num_partial <= scheduler.config.max_num_partial_prefills


def make_request(index: int, spec: RequestSpec, priority: int | None = None) -> Request:
    return Request(
        f"r{index}",
        spec.prompt_token_ids,
        spec.params,
        eos_token_id=EOS,
        arrival_time=float(spec.arrival_step),
        priority=spec.priority if priority is None else priority,
    )


def run(workload: Workload) -> tuple[Scheduler, list[Request], int]:
    """The workload run to its end, checked at every step; the scheduler, the requests, and
    how many steps ran several forwards."""
    kv = KVCacheManager(workload.num_blocks, workload.block_size, workload.enable_caching)
    scheduler = Scheduler(workload.config, kv)
    runner = FakeModelRunner(kv)
    specs = workload.requests
    requests = [make_request(index, spec) for index, spec in enumerate(specs)]
    for request, plain in zip(requests, workload.plain_sampling, strict=True):
        request.plain_sampling = plain
    prompt_lens = {r.request_id: r.num_prompt_tokens for r in requests}
    last_arrival = max(spec.arrival_step for spec in specs)
    max_steps = last_arrival + 4 * sum(
        len(spec.prompt_token_ids) + (spec.params.max_tokens or scheduler.max_model_len)
        for spec in specs
    )
    step = num_bursts = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        for spec, request in zip(specs, requests, strict=True):
            if spec.arrival_step == step:
                scheduler.add_request(request)
        aborts = [
            r.request_id
            for s, r in zip(specs, requests, strict=True)
            if s.abort_step == step and not s.abort_after_schedule
        ]
        scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        had_work = scheduler.has_unfinished_requests()
        queue_before = list(scheduler.waiting)
        running_before = list(scheduler.running)
        waiting_before = {r.request_id for r in queue_before}
        decoding_before = {r.request_id for r in running_before if r.is_prefill_done}
        output = scheduler.schedule()
        assert output.scheduled or not had_work, "no progress with requests pending"
        check_step(scheduler, output, waiting_before, decoding_before, prompt_lens)
        check_queue_order(scheduler, output, queue_before, running_before)
        assert output.sums == batch_sums(output.scheduled), "cost sums drifted while planning"
        assert output.sampling_requests() == [
            r for r, s in zip(output.requests, output.scheduled, strict=True) if s.sample
        ]
        sampled = runner.execute(output)
        num_bursts += output.num_steps > 1
        aborts = [
            r.request_id
            for s, r in zip(specs, requests, strict=True)
            if s.abort_step == step and s.abort_after_schedule
        ]
        scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        num_outputs_before = {r.request_id: r.num_output_tokens for r in output.requests}
        check_outputs(
            scheduler.update_from_output(output, in_order(output, sampled)), num_outputs_before
        )
        check_blocks(scheduler, requests)
        step += 1
        assert step <= max_steps, "no end in sight: preempt/resume loop?"
    return scheduler, requests, num_bursts


@settings(max_examples=600, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload: Workload) -> None:
    scheduler, requests, num_bursts = run(workload)
    # Coverage of the interesting paths (pytest --hypothesis-show-statistics).
    event(f"preempted: {any(r.num_preemptions for r in requests)}")
    event(f"prefix-cache hit: {any(r.num_cached_tokens for r in requests)}")
    event(f"aborted: {any(r.status is RequestStatus.FINISHED_ABORTED for r in requests)}")
    event(f"policy: {workload.config.scheduling_policy}")
    event(f"several forwards a step: {num_bursts > 0}")
    assert all(r.is_finished for r in requests)
    assert scheduler.num_waiting == scheduler.num_running == 0
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    for request in requests:
        params = request.sampling_params
        if params.max_tokens is not None:
            assert request.num_output_tokens <= params.max_tokens
        assert request.num_tokens <= max(scheduler.max_model_len, request.num_prompt_tokens + 1)
        assert (request.last_token_time is None) == (request.num_output_tokens == 0)
        if request.status is not RequestStatus.FINISHED_ABORTED:
            assert request.num_output_tokens >= 1

    # Output does not depend on batching, cache size or preemption: rerun every request that
    # was not aborted alone, with room to spare, and compare.
    for index, (spec, request) in enumerate(zip(workload.requests, requests, strict=True)):
        if request.status is RequestStatus.FINISHED_ABORTED:
            continue
        reference = run_alone(make_request(index, spec, priority=0), scheduler.max_model_len)
        assert request.output_token_ids == reference.output_token_ids
        assert request.status is reference.status


def run_alone(request: Request, max_model_len: int) -> Request:
    """The request run to its end alone, with room to spare: the reference for its tokens."""
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=max_model_len),
        KVCacheManager(num_blocks=64, block_size=4),
    )
    scheduler.add_request(request)
    runner = FakeModelRunner(scheduler.kv_cache_manager)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, in_order(output, runner.execute(output)))
    return request


class InFlightModelRunner(FakeModelRunner):
    """The fake model of a step launched before the previous one has landed (async
    scheduling): placeholder tokens read the ids the previous step sampled, as the runner reads
    them on the device."""

    def execute_in_flight(
        self, output: SchedulerOutput, previous: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        resolved = []
        for scheduled in output.scheduled:
            token_ids = list(scheduled.token_ids)
            for position, token_id in enumerate(token_ids):
                if token_id == PLACEHOLDER_TOKEN_ID:
                    token_ids[position] = previous[scheduled.request_id][0]
            entry = copy.copy(scheduled)  # a record: a msgspec Struct or a dataclass
            entry.token_ids = token_ids
            resolved.append(entry)
        return self.execute(dataclasses.replace(output, scheduled=resolved))


def run_async(workload: Workload) -> tuple[Scheduler, list[Request]]:
    """The workload with every step scheduled while the previous one is in flight: its
    tokens are placeholders until it lands, after the next step is planned and launched."""
    kv = KVCacheManager(workload.num_blocks, workload.block_size, workload.enable_caching)
    scheduler = Scheduler(workload.config, kv)
    runner = InFlightModelRunner(kv)
    specs = workload.requests
    requests = [make_request(index, spec) for index, spec in enumerate(specs)]
    last_arrival = max(spec.arrival_step for spec in specs)
    in_flight: tuple[SchedulerOutput, dict[str, list[int]]] | None = None
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests() or in_flight:
        for spec, request in zip(specs, requests, strict=True):
            if spec.arrival_step == step:
                scheduler.add_request(request)
        aborts = [r.request_id for s, r in zip(specs, requests, strict=True)
                  if s.abort_step == step and not s.abort_after_schedule]  # fmt: skip
        scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        had_work = scheduler.has_unfinished_requests()
        output = scheduler.schedule()
        assert output.scheduled or in_flight or not had_work, "no progress with requests pending"
        assert output.sums == batch_sums(output.scheduled), "cost sums drifted while planning"
        assert output.sampling_requests() == [
            r for r, s in zip(output.requests, output.scheduled, strict=True) if s.sample
        ]
        launched = None
        if output.scheduled:
            sampled = runner.execute_in_flight(output, {} if in_flight is None else in_flight[1])
            scheduler.mark_in_flight(output)
            launched = (output, sampled)
        aborts = [r.request_id for s, r in zip(specs, requests, strict=True)
                  if s.abort_step == step and s.abort_after_schedule]  # fmt: skip
        scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        if in_flight is not None:
            landed, tokens = in_flight
            update = scheduler.settle_in_flight(landed, [t[0] for t in in_order(landed, tokens)])
            check_outputs(update, None)
        in_flight = launched
        check_blocks(scheduler, requests)
        step += 1
        assert step <= 10_000, "no end in sight: preempt/resume loop?"
    assert in_flight is None
    return scheduler, requests


@settings(max_examples=400, deadline=None)
@given(workloads())
def test_async_scheduling_gives_the_same_tokens(workload: Workload) -> None:
    """Scheduled one step ahead, every request that was not aborted ends with the tokens and
    status it gets alone and in step, holding no placeholder, and every block comes back."""
    scheduler, requests = run_async(workload)
    event(f"preempted: {any(r.num_preemptions for r in requests)}")
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert scheduler.num_waiting == scheduler.num_running == 0
    for index, (spec, request) in enumerate(zip(workload.requests, requests, strict=True)):
        assert request.is_finished
        assert PLACEHOLDER_TOKEN_ID not in request.all_token_ids
        assert (request.last_token_time is None) == (request.num_output_tokens == 0)
        if request.status is RequestStatus.FINISHED_ABORTED:
            continue
        reference = run_alone(make_request(index, spec, priority=0), scheduler.max_model_len)
        assert request.output_token_ids == reference.output_token_ids
        assert request.status is reference.status
