from collections.abc import Callable

import pytest

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.roofline import batch_sums
from tandem.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tandem.request import FinishReason, Request, RequestStatus
from tandem.sampling_params import SamplingParams

EOS = 2
NextToken = Callable[[str, list[int]], int]


def model_token(request_id: str, token_ids: list[int]) -> int:
    """A stand-in model: the next token depends on the whole context, never on batching."""
    return 1000 + (sum(token_ids) * 31 + len(token_ids)) % 997


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    enable_caching: bool = False,
    clock: Callable[[], float] | None = None,
    **config: object,
) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_model_len", 256)
    kv = KVCacheManager(num_blocks, block_size, enable_caching)
    if clock is None:
        return Scheduler(SchedulerConfig(**config), kv)
    return Scheduler(SchedulerConfig(**config), kv, clock=clock)


def add(
    scheduler: Scheduler,
    request_id: str,
    num_prompt_tokens: int,
    first_token: int = 10,
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 4)
    request = Request(
        request_id,
        list(range(first_token, first_token + num_prompt_tokens)),
        SamplingParams(**params),
        eos_token_id=EOS,
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, next_token: NextToken = model_token) -> SchedulerOutput:
    output = scheduler.schedule()
    assert output.sums == batch_sums(output.scheduled)  # kept while planning, preemptions too
    sampled = [next_token(s.request_id, s.token_ids) for s in output.scheduled if s.sample]
    scheduler.update_from_output(output, sampled)
    return output


def plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in output.scheduled]


def run_to_completion(
    scheduler: Scheduler, next_token: NextToken = model_token, max_steps: int = 1000
) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler, next_token))
        assert len(outputs) < max_steps, "scheduler did not finish"
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return outputs


# -- configuration and admission -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1, got 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_model_len": -1}, "max_model_len must be >= 1, got -1"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills must be >= 1, got 0"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "must be >= max_num_seqs"),
        ({"batching_policy": "fastest"}, "batching_policy must be one of decode-first, prefill"),
        ({"scheduling_policy": "decode-first"}, "scheduling_policy must be one of fcfs, prio"),
        (
            {"enable_chunked_prefill": False, "long_prefill_token_threshold": 8},
            "leave it at 0 with enable_chunked_prefill=False",
        ),
        (
            dict(
                enable_chunked_prefill=False,
                max_num_batched_tokens=64,
                max_num_seqs=8,
                max_model_len=65,
            ),
            r"max_num_batched_tokens \(64\) must be >= max_model_len \(65\)",
        ),
    ],
)
def test_config_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_long_prefill_threshold_auto_is_half_the_budget() -> None:
    assert SchedulerConfig(max_num_batched_tokens=2048).long_prefill_token_limit == 1024
    config = SchedulerConfig(max_num_batched_tokens=2048, long_prefill_token_threshold=100)
    assert config.long_prefill_token_limit == 100


def test_add_request_rejects_requests_that_cannot_run() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    add(scheduler, "a", 3)
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        add(scheduler, "a", 3)
    with pytest.raises(ValueError, match="empty prompt"):
        add(scheduler, "b", 0)
    with pytest.raises(ValueError, match="prompt of 21 tokens is longer than max_model_len=20"):
        add(scheduler, "c", 21)
    with pytest.raises(ValueError, match=r"does not fit in the KV cache \(4 blocks of 4 tokens"):
        add(scheduler, "d", 17)
    assert scheduler.num_waiting == 1


def test_a_request_object_cannot_be_added_twice() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 3, max_tokens=1)
    run_to_completion(scheduler)
    with pytest.raises(ValueError, match="already been scheduled"):
        scheduler.add_request(request)


# -- decode-first ------------------------------------------------------------------------------


def test_short_prompt_prefills_in_one_step_then_decodes() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 5)
    first = step(scheduler)
    assert plan(first) == [("a", 5)]
    assert first.scheduled[0].sample
    assert (first.num_prefill_tokens, first.num_decode_tokens) == (5, 0)
    second = step(scheduler)
    assert plan(second) == [("a", 1)]
    assert (second.num_prefill_tokens, second.num_decode_tokens) == (0, 1)
    assert second.scheduled[0].num_computed_tokens == 5
    assert second.scheduled[0].token_ids is request.all_token_ids
    assert request.num_output_tokens == 2


def test_long_prompt_is_chunked_and_samples_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    request = add(scheduler, "a", 20)
    outputs = [step(scheduler) for _ in range(3)]
    assert [plan(o) for o in outputs] == [[("a", 8)], [("a", 8)], [("a", 4)]]
    assert [o.scheduled[0].sample for o in outputs] == [False, False, True]
    assert [o.scheduled[0].num_computed_tokens for o in outputs] == [0, 8, 16]
    assert len(outputs[2].scheduled[0].block_ids) == 5
    assert request.num_output_tokens == 1
    assert request.num_computed_tokens == 20


def test_decodes_come_first_then_prompt_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=16)
    add(scheduler, "a", 4)
    add(scheduler, "b", 4)
    assert plan(step(scheduler)) == [("a", 4), ("b", 4)]
    add(scheduler, "c", 30)
    output = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 1), ("c", 14)]
    assert (output.num_decode_tokens, output.num_prefill_tokens) == (2, 14)
    assert output.total_num_scheduled_tokens == 16


def test_in_flight_prompt_continues_before_new_ones_start() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=8, long_prefill_token_threshold=8, max_num_partial_prefills=2
    )
    add(scheduler, "a", 12)
    assert plan(step(scheduler)) == [("a", 8)]
    add(scheduler, "b", 12)
    assert plan(step(scheduler)) == [("a", 4), ("b", 4)]


def test_seat_cap() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=32)
    for name in "abc":
        add(scheduler, name, 3)
    assert plan(step(scheduler)) == [("a", 3), ("b", 3)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)


def test_token_budget_cap() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=8, long_prefill_token_threshold=8, max_num_partial_prefills=2
    )
    for name in "abc":
        add(scheduler, name, 5)
    output = step(scheduler)
    assert plan(output) == [("a", 5), ("b", 3)]
    assert output.total_num_scheduled_tokens == 8
    assert scheduler.num_waiting == 1


def test_partial_prefill_limit_lets_short_prompts_pass() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, long_prefill_token_threshold=4, max_num_partial_prefills=1
    )
    add(scheduler, "long1", 20)
    add(scheduler, "long2", 20)
    add(scheduler, "short", 3)
    assert plan(step(scheduler)) == [("long1", 4), ("short", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["long2"]  # FCFS order kept


def test_partial_prefill_limit_of_two() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, long_prefill_token_threshold=4, max_num_partial_prefills=2
    )
    add(scheduler, "long1", 20)
    add(scheduler, "long2", 20)
    add(scheduler, "long3", 20)
    assert plan(step(scheduler)) == [("long1", 4), ("long2", 4)]


def test_long_prompt_takes_at_most_the_threshold_per_step() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=64, long_prefill_token_threshold=10, max_num_partial_prefills=2
    )
    add(scheduler, "long", 35)
    add(scheduler, "short", 6)
    assert plan(step(scheduler)) == [("long", 10), ("short", 6)]
    assert plan(step(scheduler)) == [("short", 1), ("long", 10)]
    assert plan(step(scheduler)) == [("short", 1), ("long", 10)]
    assert plan(step(scheduler)) == [("short", 1), ("long", 5)]


# -- prefill-first -----------------------------------------------------------------------------


def test_prefill_first_never_mixes_prefill_and_decode() -> None:
    scheduler = make_scheduler(batching_policy="prefill-first")
    add(scheduler, "a", 4)
    assert plan(step(scheduler)) == [("a", 4)]
    add(scheduler, "b", 6)
    output = step(scheduler)
    assert plan(output) == [("b", 6)]
    assert output.num_decode_tokens == 0
    output = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 1)]
    assert output.num_prefill_tokens == 0


def test_prefill_first_runs_whole_prompts_only() -> None:
    scheduler = make_scheduler(batching_policy="prefill-first", max_num_batched_tokens=10)
    add(scheduler, "a", 6)
    add(scheduler, "b", 6)
    assert plan(step(scheduler)) == [("a", 6)]
    assert plan(step(scheduler)) == [("b", 6)]
    assert plan(step(scheduler)) == [("a", 1), ("b", 1)]


def test_prefill_first_chunks_a_prompt_longer_than_the_budget() -> None:
    scheduler = make_scheduler(batching_policy="prefill-first", max_num_batched_tokens=8)
    add(scheduler, "a", 4)
    step(scheduler)
    add(scheduler, "b", 20)
    outputs = [step(scheduler) for _ in range(4)]
    assert [plan(o) for o in outputs] == [[("b", 8)], [("b", 8)], [("b", 4)], [("a", 1), ("b", 1)]]


# -- preemption --------------------------------------------------------------------------------


def test_out_of_blocks_preempts_the_newest_and_admits_nothing() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, long_prefill_token_threshold=32)
    a = add(scheduler, "a", 8, max_tokens=4)
    b = add(scheduler, "b", 8, max_tokens=4)
    assert plan(step(scheduler)) == [("a", 8), ("b", 8)]
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    c = add(scheduler, "c", 2)
    output = step(scheduler)  # a and b both need a third block for their 9th token
    assert plan(output) == [("a", 1)]
    assert output.preempted_request_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_preemptions, b.num_output_tokens) == (0, 1, 1)
    assert c.status is RequestStatus.WAITING
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert a.num_preemptions == 0


def test_preempted_request_resumes_and_recomputes_its_outputs() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, long_prefill_token_threshold=32)
    add(scheduler, "a", 8, max_tokens=4)
    b = add(scheduler, "b", 8, max_tokens=4)
    step(scheduler)
    step(scheduler)
    assert b.status is RequestStatus.PREEMPTED
    outputs = run_to_completion(scheduler)
    resumed = next(s for o in outputs for s in o.scheduled if s.request_id == "b")
    assert (resumed.num_computed_tokens, resumed.num_new_tokens, resumed.sample) == (0, 9, True)
    assert b.num_output_tokens == 4
    assert b.status is RequestStatus.FINISHED_LENGTH


def test_chunked_resume_samples_only_once_caught_up() -> None:
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, long_prefill_token_threshold=4, max_num_partial_prefills=2
    )
    a = add(scheduler, "a", 8, max_tokens=8)
    b = add(scheduler, "b", 8, max_tokens=8)
    while b.num_preemptions == 0:
        step(scheduler)
    num_tokens_to_recompute = b.num_tokens
    outputs = run_to_completion(scheduler)
    recompute = [
        s
        for o in outputs
        for s in o.scheduled
        if s.request_id == "b" and s.num_computed_tokens < num_tokens_to_recompute
    ]
    assert [s.num_new_tokens for s in recompute] == [4, 4, 1]
    assert [s.sample for s in recompute] == [False, False, True]
    assert a.num_output_tokens == b.num_output_tokens == 8


@pytest.mark.parametrize("policy", ["decode-first", "prefill-first"])
def test_outputs_do_not_depend_on_cache_size_or_preemption(policy: str) -> None:
    def generate(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=4, batching_policy=policy, max_num_batched_tokens=16
        )
        requests = [
            add(scheduler, f"r{i}", 3 + 5 * i, first_token=i, max_tokens=9) for i in range(5)
        ]
        run_to_completion(scheduler)
        outputs = {r.request_id: r.output_token_ids for r in requests}
        return outputs, sum(r.num_preemptions for r in requests)

    reference, no_preemptions = generate(num_blocks=128)
    squeezed, num_preemptions = generate(num_blocks=9)
    assert no_preemptions == 0
    assert num_preemptions > 0
    assert squeezed == reference


# -- stop conditions ---------------------------------------------------------------------------


def generate_one(next_outputs: list[int], **params: object) -> Request:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 4, **params)
    count = 0

    def next_token(request_id: str, token_ids: list[int]) -> int:
        nonlocal count
        count += 1
        return next_outputs[count - 1] if count <= len(next_outputs) else 1000

    run_to_completion(scheduler, next_token)
    return request


def test_max_tokens_finishes_with_length() -> None:
    request = generate_one([], max_tokens=3)
    assert request.num_output_tokens == 3
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason is FinishReason.LENGTH
    assert str(request.status.finish_reason) == "length"


def test_eos_finishes_with_stop() -> None:
    request = generate_one([1000, EOS, 1000], max_tokens=10)
    assert request.output_token_ids == [1000, EOS]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == "stop"
    assert request.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    request = generate_one([EOS, EOS], max_tokens=5, ignore_eos=True)
    assert request.output_token_ids[:2] == [EOS, EOS]
    assert request.num_output_tokens == 5
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_finish_with_stop_reason() -> None:
    request = generate_one([1000, 77, 1000], max_tokens=10, stop_token_ids=[77])
    assert request.output_token_ids == [1000, 77]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 77


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    request = generate_one([EOS, 77, 1000, EOS], max_tokens=10, min_tokens=3, stop_token_ids=[77])
    assert request.output_token_ids == [EOS, 77, 1000, EOS]
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    request = generate_one([1000, EOS], max_tokens=2)
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_max_model_len_finishes_with_length() -> None:
    scheduler = make_scheduler(max_model_len=10)
    request = add(scheduler, "a", 8, max_tokens=None)
    full = add(scheduler, "b", 10, max_tokens=None)
    run_to_completion(scheduler)
    assert request.num_tokens == 10
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert full.num_output_tokens == 1  # a prompt of max_model_len still gets one token
    assert full.status is RequestStatus.FINISHED_LENGTH


def test_request_cannot_outgrow_the_whole_cache() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    request = add(scheduler, "a", 6, max_tokens=None)
    run_to_completion(scheduler, max_steps=20)
    assert request.num_tokens == 8
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_missing_sampled_token_is_an_error() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 4)
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        scheduler.update_from_output(output, [])
    with pytest.raises(ValueError, match="more sampled tokens than the step has sampling"):
        scheduler.update_from_output(output, [5, 6])


def test_finished_request_frees_blocks_and_is_reported_once() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 4, max_tokens=1)
    add(scheduler, "b", 4, max_tokens=3)
    step(scheduler)
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    assert step(scheduler).finished_request_ids == ["a"]
    assert step(scheduler).finished_request_ids == []
    assert scheduler.num_running == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["b"]


# -- aborts ------------------------------------------------------------------------------------


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    running = add(scheduler, "running", 6)
    waiting = add(scheduler, "waiting", 6)
    step(scheduler)
    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert running.status is waiting.status is RequestStatus.FINISHED_ABORTED
    assert running.status.finish_reason is FinishReason.ABORT
    assert running.finished_time is not None
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 0)
    assert sorted(scheduler.schedule().finished_request_ids) == ["running", "waiting"]
    scheduler.finish_requests("running", RequestStatus.FINISHED_STOPPED)  # already finished
    assert running.status is RequestStatus.FINISHED_ABORTED


def test_abort_between_schedule_and_update_is_ignored() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a", 4)
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    update = scheduler.update_from_output(output, [[1000]])
    assert update.outputs == update.requests == update.finished == []
    assert request.num_output_tokens == 0


def test_finish_requests_needs_a_finished_status() -> None:
    scheduler = make_scheduler()
    add(scheduler, "a", 4)
    with pytest.raises(ValueError, match="finished status, got RUNNING"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


# -- telemetry ---------------------------------------------------------------------------------


def test_timestamps_come_from_the_clock() -> None:
    now = [100.0]
    scheduler = make_scheduler(clock=lambda: now[0])
    request = add(scheduler, "a", 4, max_tokens=3)
    token_times = []
    for _ in range(3):
        now[0] += 1.0
        step(scheduler)
        token_times.append(request.last_token_time)
    assert request.first_scheduled_time == 101.0
    assert request.first_token_time == 101.0
    assert token_times == [101.0, 102.0, 103.0]
    assert request.finished_time == 103.0


def test_cached_tokens_count_first_admission_only() -> None:
    scheduler = make_scheduler(
        num_blocks=6, block_size=4, enable_caching=True, long_prefill_token_threshold=32
    )
    first = add(scheduler, "first", 9, max_tokens=1)
    run_to_completion(scheduler)
    assert first.num_cached_tokens == 0
    a = add(scheduler, "a", 9, max_tokens=6)  # same prompt: 2 blocks cached
    b = add(scheduler, "b", 9, first_token=50, max_tokens=6)
    output = step(scheduler)
    assert plan(output) == [("a", 1), ("b", 9)]
    assert a.num_cached_tokens == 8
    while b.num_preemptions == 0:
        step(scheduler)
    assert a.num_preemptions == 0
    outputs = run_to_completion(scheduler)
    resumed = next(s for o in outputs for s in o.scheduled if s.request_id == "b")
    assert resumed.num_computed_tokens > 0  # its own blocks were hits on resume...
    assert b.num_cached_tokens == 0  # ...but recompute is not counted as a cache hit
    assert a.num_cached_tokens == 8


def test_a_token_landing_after_its_request_was_aborted_goes_nowhere() -> None:
    """Async scheduling: a request aborted while its step runs, and a new request under the
    same id, must not get the old step's token."""
    scheduler = make_scheduler()
    add(scheduler, "a", 4, max_tokens=8)
    in_flight = scheduler.schedule()
    scheduler.mark_in_flight(in_flight)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    reused = add(scheduler, "a", 6, first_token=50, max_tokens=8)
    update = scheduler.settle_in_flight(in_flight, [999])
    assert update.outputs == update.requests == update.finished == []
    assert reused.all_token_ids == list(range(50, 56)) and reused.output_token_ids == []
    assert reused.last_token_time is None and reused.status is RequestStatus.WAITING
