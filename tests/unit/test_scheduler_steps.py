"""Multi-step scheduling (core/scheduler.py _schedule_steps): a step whose only work is one
plainly sampled request's next token runs several forwards, with the blocks for all of them
allocated when it is planned; any other step runs one. Its tokens are recorded as a verified
draft step's are: up to the first that ends the request."""

from __future__ import annotations

import pytest
from test_scheduler import EOS, add, make_scheduler
from test_scheduler_spec import LinearCost, prefill

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import MULTI_STEP_WINDOW, Scheduler, SchedulerConfig
from tandem.request import RequestStatus

from helpers import in_order


def lone_decode(num_scheduler_steps: int = 4, max_tokens: int = 20, **params):
    """A scheduler with one plainly sampled request past its first token (blocks of 4
    tokens)."""
    scheduler = make_scheduler(num_scheduler_steps=num_scheduler_steps)
    request = add(scheduler, "a", 5, max_tokens=max_tokens, **params)
    request.plain_sampling = True  # the engine core's verdict on its sampling params
    prefill(scheduler, ["a"])
    return scheduler, request


def test_a_lone_greedy_decode_runs_several_forwards_in_its_blocks():
    scheduler, request = lone_decode()
    kv = scheduler.kv_cache_manager
    output = scheduler.schedule()
    assert output.num_steps == 4
    ((entry,),) = [output.scheduled]
    assert (entry.num_computed_tokens, entry.num_new_tokens, entry.sample) == (5, 1, True)
    assert output.num_decode_tokens == 1 and output.sums.num_new_tokens == 1  # one forward's
    # Tokens 5..8 are fed to the four forwards: their KV needs slots up to position 8.
    assert len(kv.get_block_ids(request.request_id)) * kv.block_size >= 9
    update = scheduler.update_from_output(output, [[11, 12, 13, 14]])
    assert update.requests == [request] and update.finished == []
    assert update.outputs[0].new_token_ids == [11, 12, 13, 14]
    assert request.output_token_ids == [500, 11, 12, 13, 14]
    assert request.num_computed_tokens == 9


def test_a_stop_token_within_the_burst_ends_the_request_there():
    scheduler, request = lone_decode()
    output = scheduler.schedule()
    assert output.num_steps == 4
    scheduler.update_from_output(output, [[11, EOS]])  # the runner stopped after EOS
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [500, 11, EOS]
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_more_tokens_than_forwards_is_an_error():
    scheduler, _ = lone_decode(num_scheduler_steps=2)
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="in 2 forwards"):
        scheduler.update_from_output(output, [[11, 12, 13]])


def test_the_burst_ends_at_the_requests_length_limit():
    scheduler, request = lone_decode(num_scheduler_steps=8, max_tokens=4)
    output = scheduler.schedule()
    assert output.num_steps == 3  # one output token so far, max_tokens 4
    scheduler.update_from_output(output, [[11, 12, 13]])
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert len(request.output_token_ids) == 4


def test_the_burst_fits_the_window_by_the_cost_models_forecast():
    scheduler, _ = lone_decode(num_scheduler_steps=8)
    scheduler.cost_model = LinearCost(MULTI_STEP_WINDOW / 3, 0.0)
    assert scheduler.schedule().num_steps == 3


def test_an_itl_target_shorter_than_the_window_bounds_the_burst():
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, num_scheduler_steps=8,
                             target_step_time=MULTI_STEP_WINDOW / 2)  # fmt: skip
    scheduler = Scheduler(config, KVCacheManager(64, 4, False),
                          cost_model=LinearCost(MULTI_STEP_WINDOW / 8, 0.0))  # fmt: skip
    request = add(scheduler, "a", 5, max_tokens=20)
    request.plain_sampling = True
    prefill(scheduler, ["a"])
    assert scheduler.schedule().num_steps == 4


def test_one_forward_where_the_burst_would_make_someone_wait_or_change_its_tokens():
    scheduler, request = lone_decode()
    add(scheduler, "b", 3)  # a request waiting for a seat would wait for the burst
    assert scheduler.schedule().num_steps == 1

    scheduler, request = lone_decode()
    request.plain_sampling = False  # penalized, biased or reporting logprobs
    assert scheduler.schedule().num_steps == 1

    scheduler, request = lone_decode(min_tokens=3)  # EOS blocked for its next tokens
    assert scheduler.schedule().num_steps == 1

    scheduler, request = lone_decode(num_scheduler_steps=1)
    assert scheduler.schedule().num_steps == 1


def two_decoding(multi_step_max_seqs: int, **params) -> tuple:
    scheduler = make_scheduler(num_scheduler_steps=8, multi_step_max_seqs=multi_step_max_seqs)
    requests = [add(scheduler, name, 3, max_tokens=20, **params) for name in "ab"]
    for request in requests:
        request.plain_sampling = True
    first = scheduler.schedule()  # the prompts, and the first tokens: one forward
    assert first.num_steps == 1
    scheduler.update_from_output(first, in_order(first, {"a": [7], "b": [8]}))
    return scheduler, requests


def test_running_requests_burst_together_up_to_the_runners_rows():
    scheduler, _ = two_decoding(1)
    assert scheduler.schedule().num_steps == 1  # the runner takes one row at a time
    scheduler, requests = two_decoding(4)
    output = scheduler.schedule()
    assert output.num_steps == 8 and [s.num_new_tokens for s in output.scheduled] == [1, 1]
    kv = scheduler.kv_cache_manager
    # Positions 3..10 fed to the eight forwards: three blocks of 4 each.
    assert [len(kv.get_block_ids(r.request_id)) for r in requests] == [3, 3]
    # b's stop token after the second forward ends the burst for both: a keeps two tokens,
    # and gives back the block it held for the other six.
    scheduler.update_from_output(output, in_order(output, {"a": [11, 12], "b": [13, EOS]}))
    a, b = requests
    assert b.status is RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7, 11, 12]
    assert a.num_computed_tokens == 5 and len(kv.get_block_ids("a")) == 2


def test_no_burst_where_its_blocks_are_not_there(monkeypatch):
    scheduler, _ = lone_decode()
    kv = scheduler.kv_cache_manager
    allocate = kv.allocate_slots

    def pool_without_room_for_more(request, num_new_tokens, *args):
        return None if num_new_tokens > 1 else allocate(request, num_new_tokens, *args)

    monkeypatch.setattr(kv, "allocate_slots", pool_without_room_for_more)
    output = scheduler.schedule()
    assert output.num_steps == 1 and output.scheduled[0].num_new_tokens == 1


def test_a_burst_given_up_leaves_each_entry_its_requests_blocks(monkeypatch):
    """The burst's blocks fit a's table but not b's: a gives its extra blocks back (a new,
    shorter list), and the step's entries carry the tables the requests hold now, not the
    lists their decodes were planned with."""
    scheduler, _ = two_decoding(4)
    kv = scheduler.kv_cache_manager
    allocate = kv.allocate_slots

    def no_burst_for_b(request, num_new_tokens, *args):
        if request.request_id == "b" and num_new_tokens > 1:
            return None
        return allocate(request, num_new_tokens, *args)

    monkeypatch.setattr(kv, "allocate_slots", no_burst_for_b)
    output = scheduler.schedule()
    assert output.num_steps == 1
    assert [s.block_ids for s in output.scheduled] == [kv.get_block_ids(r) for r in "ab"]
    assert all(s.block_ids is kv.get_block_ids(s.request_id) for s in output.scheduled)


def test_steps_in_flight_refuse_a_burst():
    scheduler, _ = lone_decode()
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="several forwards"):
        scheduler.mark_in_flight(output)


def test_config_errors():
    with pytest.raises(ValueError, match="num_scheduler_steps must be >= 1"):
        SchedulerConfig(num_scheduler_steps=0)


def test_a_step_verifying_drafts_runs_one_forward_and_one_without_them_a_burst():
    """With speculative decoding a lone greedy request's step either verifies the proposer's
    drafts or, where it has none (or the scheduler takes none), runs a burst."""
    scheduler = make_scheduler(num_scheduler_steps=4, num_speculative_tokens=3,
                               adaptive_speculation=False)  # fmt: skip
    request = add(scheduler, "a", 5, max_tokens=20)
    request.plain_sampling = True
    prefill(scheduler, ["a"])
    request.spec_token_ids = [7, 8]
    verifying = scheduler.schedule()
    assert (verifying.num_draft_tokens, verifying.num_steps) == (2, 1)
    scheduler.update_from_output(verifying, [[7, 9]])  # one draft accepted
    request.spec_token_ids = []  # no n-gram found
    burst = scheduler.schedule()
    assert (burst.num_draft_tokens, burst.num_steps) == (0, 4)
