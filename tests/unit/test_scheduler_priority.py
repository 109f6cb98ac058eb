"""vLLM's scheduling_policy ("fcfs" / "priority") and enable_chunked_prefill in the scheduler,
on a fake clock: arrival times are set by the test, never read from the machine."""

from __future__ import annotations

import pytest
from test_scheduler import make_scheduler, plan, run_to_completion, step

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams

EOS = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> float:
        self.now += seconds
        return self.now


def add(
    scheduler: Scheduler,
    request_id: str,
    num_prompt_tokens: int,
    *,
    arrival_time: float,
    priority: int = 0,
    max_tokens: int = 4,
) -> Request:
    request = Request(
        request_id,
        list(range(10, 10 + num_prompt_tokens)),
        SamplingParams(max_tokens=max_tokens),
        eos_token_id=EOS,
        arrival_time=arrival_time,
        priority=priority,
    )
    scheduler.add_request(request)
    return request


def admission_order(scheduler: Scheduler) -> list[str]:
    """Run to the end; the order in which requests were first scheduled."""
    order: list[str] = []
    for output in run_to_completion(scheduler):
        order += [s.request_id for s in output.scheduled if s.request_id not in order]
    return order


def test_priority_admits_lowest_value_first_and_arrival_among_equals() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority", clock=clock)
    add(scheduler, "late-urgent", 3, arrival_time=clock.tick(), priority=-5)
    add(scheduler, "p1-second", 3, arrival_time=102.0, priority=1)
    add(scheduler, "p1-first", 3, arrival_time=101.5, priority=1)
    add(scheduler, "p0", 3, arrival_time=clock.tick(), priority=0)
    add(scheduler, "p0-same-time", 3, arrival_time=clock.now, priority=0)  # add order breaks it
    assert [r.request_id for r in scheduler.waiting] == [
        "late-urgent", "p0", "p0-same-time", "p1-first", "p1-second",
    ]  # fmt: skip
    assert admission_order(scheduler) == [
        "late-urgent", "p0", "p0-same-time", "p1-first", "p1-second",
    ]  # fmt: skip


def test_fcfs_is_add_order_and_refuses_a_priority() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1, clock=clock)
    add(scheduler, "a", 3, arrival_time=clock.tick(5))
    add(scheduler, "b", 3, arrival_time=clock.tick(-3))  # an earlier arrival, added later
    with pytest.raises(ValueError, match="priority 3, but priority scheduling is off"):
        add(scheduler, "c", 3, arrival_time=clock.tick(), priority=3)
    assert admission_order(scheduler) == ["a", "b"]


def test_a_higher_priority_arrival_waits_for_a_seat_but_jumps_the_queue() -> None:
    clock = FakeClock()
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority", clock=clock)
    add(scheduler, "running", 3, arrival_time=clock.tick(), priority=9, max_tokens=3)
    step(scheduler)
    add(scheduler, "queued", 3, arrival_time=clock.tick(), priority=5)
    add(scheduler, "urgent", 3, arrival_time=clock.tick(), priority=0)
    assert plan(step(scheduler)) == [("running", 1)]  # no preemption to make room
    assert admission_order(scheduler) == ["running", "urgent", "queued"]


def three_running(policy: str, priorities: tuple[int, int, int]) -> tuple[Scheduler, FakeClock]:
    """a, b, c (in that arrival order) each hold 2 of the 6 blocks, all full: the next decode
    step needs a new block for each."""
    clock = FakeClock()
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=32,
            max_num_seqs=8,
            max_model_len=64,
            long_prefill_token_threshold=32,
            scheduling_policy=policy,
        ),
        KVCacheManager(num_blocks=6, block_size=4, enable_caching=False),
        clock=clock,
    )
    for name, priority in zip("abc", priorities, strict=True):
        add(scheduler, name, 7, arrival_time=clock.tick(), priority=priority, max_tokens=20)
    step(scheduler)  # prompts of 7 tokens
    step(scheduler)  # each computes its 8th token: two full blocks each
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    return scheduler, clock


def test_fcfs_preempts_the_newest() -> None:
    scheduler, _ = three_running("fcfs", (0, 0, 0))
    output = step(scheduler)
    assert output.preempted_request_ids == ["c"]
    assert plan(output) == [("a", 1), ("b", 1)]


def test_priority_preempts_the_highest_value_first() -> None:
    scheduler, _ = three_running("priority", (0, 1, 0))
    output = step(scheduler)
    assert output.preempted_request_ids == ["b"]  # not c, the newest
    assert plan(output) == [("a", 1), ("c", 1)]
    assert scheduler.requests["b"].status is RequestStatus.PREEMPTED


def test_priority_preempts_the_latest_arrival_among_equals() -> None:
    scheduler, _ = three_running("priority", (3, 3, 3))
    assert step(scheduler).preempted_request_ids == ["c"]


def test_priority_preempts_the_lowest_priority_even_when_it_runs_first() -> None:
    # a (priority 2) arrived alone and runs first; b (0) and c (1) joined later. When b needs a
    # block, a is the victim although it was already scheduled this step: its tokens go back.
    clock = FakeClock()
    scheduler = make_scheduler(
        num_blocks=4, block_size=4, long_prefill_token_threshold=32, scheduling_policy="priority"
    )
    add(scheduler, "a", 4, arrival_time=clock.tick(), priority=2, max_tokens=20)
    step(scheduler)
    add(scheduler, "b", 4, arrival_time=clock.tick(), priority=0, max_tokens=20)
    add(scheduler, "c", 4, arrival_time=clock.tick(), priority=1, max_tokens=20)
    assert plan(step(scheduler)) == [("a", 1), ("b", 4), ("c", 4)]
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    output = step(scheduler)
    assert output.preempted_request_ids == ["a"]
    assert plan(output) == [("b", 1), ("c", 1)]
    assert output.total_num_scheduled_tokens == 2


def test_a_preempted_request_waits_behind_more_urgent_ones() -> None:
    scheduler, clock = three_running("priority", (0, 1, 0))
    add(scheduler, "urgent", 3, arrival_time=clock.tick(), priority=-1, max_tokens=1)
    add(scheduler, "lazy", 3, arrival_time=clock.tick(), priority=7, max_tokens=1)
    step(scheduler)  # preempts b
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "b", "lazy"]


def test_equal_priorities_schedule_exactly_like_fcfs() -> None:
    def run(policy: str) -> list[list[tuple[str, int]]]:
        scheduler = make_scheduler(
            num_blocks=10, block_size=4, max_num_batched_tokens=16, scheduling_policy=policy
        )
        for i in range(6):
            add(scheduler, f"r{i}", 3 + 4 * i, arrival_time=float(i), max_tokens=6)
        return [plan(o) for o in run_to_completion(scheduler)]

    assert run("priority") == run("fcfs")


# -- enable_chunked_prefill=False ------------------------------------------------------------


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16, enable_chunked_prefill=False
    )
    add(scheduler, "a", 10, arrival_time=1.0)
    add(scheduler, "b", 10, arrival_time=2.0)  # 6 tokens left in the budget: not chunked
    add(scheduler, "c", 2, arrival_time=3.0)  # FCFS: does not pass b
    assert plan(step(scheduler)) == [("a", 10)]
    assert plan(step(scheduler)) == [("a", 1), ("b", 10), ("c", 2)]


def test_without_chunked_prefill_under_prefill_first() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=16,
        max_num_seqs=4,
        max_model_len=16,
        enable_chunked_prefill=False,
        batching_policy="prefill-first",
    )
    add(scheduler, "a", 16, arrival_time=1.0)
    add(scheduler, "b", 16, arrival_time=2.0)
    assert plan(step(scheduler)) == [("a", 16)]
    assert plan(step(scheduler)) == [("b", 16)]
