"""The scheduler's side of speculative decoding: drafts counted against the budget with their
KV slots reserved, rollback of rejected drafts (progress and blocks), the caps on how many a
request verifies, and the adaptive choice from the step-cost model."""

import pytest
from test_scheduler import add, make_scheduler

from tandem.core.roofline import BatchSums
from tandem.core.scheduler import MIN_SPECULATION_GAIN, _StepPlan
from tandem.core.spec_guard import MIN_STEPS, SpeculationGuard
from tandem.request import RequestStatus

from helpers import AllowingGuard, in_order


class LinearCost:
    """A step costs `constant` plus `per_token` for each new token; steps of at most
    `packed_max_tokens` use packed weights (0: none do)."""

    headroom = 0.0
    max_observed_tokens = 10**9

    def __init__(self, constant: float, per_token: float, packed_max_tokens: int = 0) -> None:
        self.constant, self.per_token = constant, per_token
        self.packed_max_tokens = packed_max_tokens

    def predict(self, sums: BatchSums) -> float:
        return self.constant + self.per_token * sums.num_new_tokens


def prefill(scheduler, request_ids, first_token=500):
    """Run the prompts through, sampling one token each."""
    output = scheduler.schedule()
    assert {s.request_id for s in output.scheduled if s.sample} == set(request_ids)
    scheduler.update_from_output(output, in_order(output, {i: [first_token] for i in request_ids}))


def test_drafts_are_scheduled_with_their_slots_and_counted_in_the_budget():
    scheduler = make_scheduler(num_speculative_tokens=3, adaptive_speculation=False)
    request = add(scheduler, "a", 5, max_tokens=20)
    prefill(scheduler, ["a"])
    request.spec_token_ids = [7, 8, 9, 10]  # more than the cap: three are verified
    output = scheduler.schedule()
    (scheduled,) = output.scheduled
    assert scheduled.draft_token_ids == [7, 8, 9]
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens) == (5, 4)
    assert scheduled.sample
    assert output.total_num_scheduled_tokens == 4
    assert (output.num_decode_tokens, output.num_draft_tokens) == (4, 3)
    assert output.sums.num_sampled == 4  # a logits row at the last token and at each draft
    # Positions 5..8 need 9 slots: three blocks of 4.
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 3


def test_rejected_drafts_roll_back_progress_and_free_their_blocks():
    scheduler = make_scheduler(num_speculative_tokens=4, adaptive_speculation=False)
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "a", 7, max_tokens=20)
    prefill(scheduler, ["a"])  # 8 tokens known, 7 computed: two blocks
    request.spec_token_ids = [7, 8, 9, 10]
    output = scheduler.schedule()
    assert len(kv.get_block_ids("a")) == 3  # positions 7..11
    free_before = kv.num_free_blocks
    # The first draft is accepted, the second rejected: the target's own token follows.
    scheduler.update_from_output(output, [[7, 42]])
    assert request.output_token_ids == [500, 7, 42]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert len(kv.get_block_ids("a")) == 3  # position 9 still needs the third block
    assert kv.num_free_blocks == free_before
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (4, 1)
    request.spec_token_ids = [1, 2, 3, 4]
    output = scheduler.schedule()  # positions 9..13: four blocks
    table = kv.get_block_ids("a")
    assert len(table) == 4
    scheduler.update_from_output(output, [[5]])  # all rejected
    assert request.num_computed_tokens == 10
    assert len(kv.get_block_ids("a")) == 3  # the fourth held only rejected drafts
    assert kv.num_free_blocks == free_before
    # A new list: the runner's block tables take a list they have seen to have only grown.
    assert kv.get_block_ids("a") is not table and len(table) == 4


def test_all_drafts_accepted_and_the_bonus_token():
    scheduler = make_scheduler(num_speculative_tokens=2, adaptive_speculation=False)
    request = add(scheduler, "a", 4, max_tokens=20)
    prefill(scheduler, ["a"])
    request.spec_token_ids = [7, 8]
    scheduler.update_from_output(scheduler.schedule(), [[7, 8, 9]])
    assert request.output_token_ids == [500, 7, 8, 9]
    assert request.num_computed_tokens == 7


def test_a_stop_inside_an_accepted_run_ends_the_request_at_that_token():
    scheduler = make_scheduler(num_speculative_tokens=3, adaptive_speculation=False)
    kv = scheduler.kv_cache_manager
    request = add(scheduler, "a", 4, max_tokens=10, stop_token_ids=[77])
    prefill(scheduler, ["a"])
    request.spec_token_ids = [77, 6, 7]
    update = scheduler.update_from_output(scheduler.schedule(), [[77, 6, 7, 8]])
    assert update.requests == [request] and update.finished == [0]
    assert update.outputs[0].new_token_ids == [77] and update.outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [500, 77]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaks


def test_more_tokens_than_drafts_plus_one_is_an_error():
    scheduler = make_scheduler(num_speculative_tokens=2, adaptive_speculation=False)
    request = add(scheduler, "a", 4, max_tokens=10)
    prefill(scheduler, ["a"])
    request.spec_token_ids = [1]
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="verified 1 drafts"):
        scheduler.update_from_output(output, [[1, 2, 3]])


def test_drafts_stay_within_max_tokens_and_max_model_len():
    scheduler = make_scheduler(
        num_speculative_tokens=4, adaptive_speculation=False, max_model_len=12
    )
    near_max_tokens = add(scheduler, "a", 4, max_tokens=3)
    near_model_len = add(scheduler, "b", 8, first_token=60, max_tokens=50)
    prefill(scheduler, ["a", "b"])
    near_max_tokens.spec_token_ids = [1, 2, 3, 4]
    near_model_len.spec_token_ids = [1, 2, 3, 4]
    drafts = {s.request_id: s.draft_token_ids for s in scheduler.schedule().scheduled}
    # a: one output, max 3: one draft plus the target's token. b: 9 tokens, length 12.
    assert drafts == {"a": [1], "b": [1, 2, 3]}


def test_drafts_wait_behind_the_budget_and_never_preempt():
    scheduler = make_scheduler(
        num_blocks=4, num_speculative_tokens=4, adaptive_speculation=False,
        max_num_batched_tokens=8, max_num_seqs=8,
    )  # fmt: skip
    a = add(scheduler, "a", 4, max_tokens=30)
    b = add(scheduler, "b", 3, first_token=60, max_tokens=30)
    prefill(scheduler, ["a", "b"])  # a: 5 tokens (2 blocks), b: 4 tokens (1 block)
    a.spec_token_ids = [1, 2, 3, 4]
    b.spec_token_ids = [1, 2, 3, 4]
    output = scheduler.schedule()
    drafts = {s.request_id: s.draft_token_ids for s in output.scheduled}
    # a's drafts need a third block (positions 4..8), the last free one; b's would need a
    # second block and none is left: b verifies nothing, and nobody is preempted.
    assert drafts == {"a": [1, 2, 3, 4], "b": []}
    assert output.preempted_request_ids == []
    assert output.total_num_scheduled_tokens == 6


def test_speculation_is_off_with_many_running_requests():
    scheduler = make_scheduler(
        num_speculative_tokens=2, adaptive_speculation=False, speculation_max_running=2
    )
    requests = [add(scheduler, name, 3, first_token=10 * i) for i, name in enumerate("ab")]
    prefill(scheduler, ["a", "b"])
    for request in requests:
        request.spec_token_ids = [1, 2]
    assert scheduler.schedule().num_draft_tokens == 0


def empty_adaptive_scheduler(cost: LinearCost):
    """The step-cost model's choice of drafts, with every step let through by the measured
    check (its own tests: test_spec_guard, and the probing test below)."""
    scheduler = make_scheduler(
        num_speculative_tokens=4, max_num_batched_tokens=512, max_num_seqs=128,
        num_blocks=1024,
    )  # fmt: skip
    scheduler.cost_model = cost
    scheduler.speculation_guard = AllowingGuard()
    return scheduler


def adaptive_scheduler(cost: LinearCost, num_requests: int):
    scheduler = empty_adaptive_scheduler(cost)
    names = [f"r{i}" for i in range(num_requests)]
    requests = [add(scheduler, name, 3, first_token=10 + i, max_tokens=50)
                for i, name in enumerate(names)]  # fmt: skip
    prefill(scheduler, names)
    for request in requests:
        request.spec_token_ids = [1, 2, 3, 4]
    return scheduler, requests


def test_adaptive_drafts_while_they_pay_for_their_time():
    # A step costs 10 plus 1 per token, a draft is accepted half the time: expected tokens
    # per time are 1/11, 1.5/12, 1.75/13, 1.875/14, 1.94/15 for 0..4 drafts: two is best.
    scheduler, (request,) = adaptive_scheduler(LinearCost(10.0, 1.0), 1)
    request.recent_accepted, request.recent_rejections = 50.0, 50.0  # acceptance ~ 0.5
    (scheduled,) = scheduler.schedule().scheduled
    assert len(scheduled.draft_token_ids) == 2
    # Drafts that are nearly always right are all worth it.
    scheduler, (request,) = adaptive_scheduler(LinearCost(10.0, 1.0), 1)
    request.recent_accepted, request.recent_rejections = 100.0, 0.0
    (scheduled,) = scheduler.schedule().scheduled
    assert len(scheduled.draft_token_ids) == 4


def test_greedy_and_sampled_requests_have_their_own_acceptance_prior():
    # Sampled requests' drafts were all rejected. A new greedy request starts from its own
    # kind's record (none yet: even odds), so it drafts two, as in a fresh engine; from the
    # sampled record (~0.1) it would draft none.
    scheduler = empty_adaptive_scheduler(LinearCost(10.0, 1.0))
    sampled = add(scheduler, "s", 3, max_tokens=60)
    prefill(scheduler, ["s"])
    while not sampled.is_finished:
        sampled.spec_token_ids = [1, 2, 3, 4]
        scheduler.update_from_output(scheduler.schedule(), [[9]])
    stats = scheduler.spec_decode_stats
    assert stats.num_accepted_tokens == 0 and stats.num_rejections >= 5
    greedy = add(scheduler, "g", 3, first_token=50, max_tokens=50, temperature=0.0)
    prefill(scheduler, ["g"])
    greedy.spec_token_ids = [1, 2, 3, 4]
    (scheduled,) = scheduler.schedule().scheduled
    assert len(scheduled.draft_token_ids) == 2


class SteppedCost(LinearCost):
    """Steps above `small` tokens cost `jump` more (e.g. past a CUDA graph size)."""

    def __init__(self, constant: float, per_token: float, small: int, jump: float) -> None:
        super().__init__(constant, per_token)
        self.small, self.jump = small, jump

    def predict(self, sums: BatchSums) -> float:
        return super().predict(sums) + (self.jump if sums.num_new_tokens > self.small else 0.0)


def test_adaptive_sees_past_a_jump_in_step_cost():
    # 8 decodes fill the small-step regime; one draft alone would pay the whole jump, but
    # with drafts this good, verifying all of them pays it back.
    scheduler, requests = adaptive_scheduler(SteppedCost(10.0, 0.5, small=8, jump=6.0), 8)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 100.0, 0.0
    assert scheduler.schedule().num_draft_tokens == 8 * 4
    # Poor drafts do not pay the jump back: none are verified.
    scheduler, requests = adaptive_scheduler(SteppedCost(10.0, 0.5, small=8, jump=6.0), 8)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 20.0, 80.0
    assert scheduler.schedule().num_draft_tokens == 0


def test_drafts_never_push_a_step_past_the_packed_weights():
    """8 decodes with drafts that would pay even past the jump: within a packed size of 12,
    only 4 drafts; a step already past it (packed size 4) takes them all."""
    cost = SteppedCost(10.0, 0.5, small=12, jump=6.0)
    cost.packed_max_tokens = 12
    scheduler, requests = adaptive_scheduler(cost, 8)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 100.0, 0.0
    assert scheduler.schedule().num_draft_tokens == 4
    cost = SteppedCost(10.0, 0.5, small=4, jump=6.0)
    cost.packed_max_tokens = 4
    scheduler, requests = adaptive_scheduler(cost, 8)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 100.0, 0.0
    assert scheduler.schedule().num_draft_tokens == 8 * 4


def test_adaptive_turns_speculation_off_under_load():
    # 64 decodes share the constant: a token costs 10/64 + 1, so a draft must be emitted with
    # a chance above ~0.86 to pay: at acceptance 0.5 no request drafts.
    scheduler, requests = adaptive_scheduler(LinearCost(10.0, 1.0), 64)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 50.0, 50.0
    assert scheduler.schedule().num_draft_tokens == 0
    # Requests whose drafts are nearly always right still draft.
    scheduler, requests = adaptive_scheduler(LinearCost(10.0, 1.0), 64)
    for request in requests:
        request.recent_accepted, request.recent_rejections = 100.0, 0.0
    assert scheduler.schedule().num_draft_tokens == 64 * 4


def test_a_request_that_stopped_drafting_tries_again_later():
    scheduler, (request,) = adaptive_scheduler(LinearCost(1.0, 1.0), 1)
    request.recent_accepted, request.recent_rejections = 0.0, 40.0
    # The engine's drafts for requests of its kind are mostly right.
    scheduler.verified_by_kind[request.sampling_params.is_greedy] = (90, 10)
    drafted = []
    while not request.is_finished and not any(drafted):
        output = scheduler.schedule()
        drafted.append(output.num_draft_tokens)
        (scheduled,) = output.scheduled
        accepted = scheduled.draft_token_ids  # all of them
        scheduler.update_from_output(output, [[*accepted, 9]])
        request.spec_token_ids = [1, 2, 3, 4]
    assert drafted[0] == 0  # its own record says no
    assert drafted[-1] > 0  # as it decays, the engine-wide rate brings it back
    assert len(drafted) > 10


def drafts_under(guard: SpeculationGuard) -> list[tuple[int, bool]]:
    """Drafts verified per step, and whether the step probed, for a fresh request of a kind
    with no record yet (even odds) under `guard`, where every draft is right, until it
    finishes. A step costs 1 plus 1 per token: at even odds no number of drafts pays (1/2
    tokens a second with none, 1.5/3 with one, ...); were all accepted, 4 would (5/6)."""
    scheduler, (request,) = adaptive_scheduler(LinearCost(1.0, 1.0), 1)
    scheduler.speculation_guard = guard
    steps = []
    while not request.is_finished:
        request.spec_token_ids = [21, 22, 23, 24]
        output = scheduler.schedule()
        (scheduled,) = output.scheduled
        drafts = scheduled.draft_token_ids
        steps.append((len(drafts), guard.probing))
        scheduler.update_from_output(output, [[*drafts, 9]])
        guard.observe(1, bool(drafts), 1 + len(drafts), 2.0 + len(drafts))
    return steps


def test_drafts_the_estimates_refuse_are_probed_until_measured():
    """The estimates alone never verify a draft here, so they never learn that every one is
    right (greedy n-gram requests at batch 1 verified none in 2.5 rounds of the benchmark).
    The measured check's first steps probe: they verify every draft, as if all would be
    accepted; the estimates learn from them, and the step-cost model's own choice takes
    drafts on."""
    steps = drafts_under(SpeculationGuard(min_gain=MIN_SPECULATION_GAIN))
    assert steps[0] == (4, True)
    assert sum(probing for _, probing in steps) == MIN_STEPS
    assert (4, False) in steps
    # Without probing (a costly proposer's guard), nothing is ever verified.
    assert not any(drafts for drafts, _ in drafts_under(SpeculationGuard(explores_refusals=False)))


def test_a_request_with_more_than_its_last_token_to_compute_verifies_no_drafts():
    """Resuming after a preemption, a request recomputes its tokens in chunks: stale guesses
    must never replace them (they are dropped at the preemption, and refused anyway)."""
    scheduler = make_scheduler(
        num_speculative_tokens=3, adaptive_speculation=False, max_num_batched_tokens=8,
        long_prefill_token_threshold=4,
    )  # fmt: skip
    request = add(scheduler, "a", 6, max_tokens=20)
    while request.num_output_tokens < 5:
        output = scheduler.schedule()
        scheduler.update_from_output(output, [500 for s in output.scheduled if s.sample])
    request.spec_token_ids = [1, 2, 3]
    scheduler._preempt(request, _StepPlan(token_budget=8))
    assert not request.spec_token_ids
    seen = []
    while request.num_output_tokens == 5:
        request.spec_token_ids = [1, 2, 3]  # a proposer that did not hear of the preemption
        output = scheduler.schedule()
        (scheduled,) = output.scheduled
        seen.append((scheduled.num_computed_tokens, scheduled.num_new_tokens))
        if scheduled.num_computed_tokens + scheduled.num_new_tokens < request.num_tokens:
            assert scheduled.draft_token_ids == [] and not scheduled.sample
        scheduler.update_from_output(output, [500 for s in output.scheduled if s.sample])
    # 11 tokens recomputed in chunks of 4: the prompt is done after the second, the third
    # still has tokens to catch up on, and only then do guesses ride along.
    assert seen[:3] == [(0, 4), (4, 4), (8, 3)]


class TableCost:
    """Step time by new tokens, from a table (a staircase no line follows)."""

    packed_max_tokens = 0
    headroom = 0.0
    max_observed_tokens = 10**9

    def __init__(self, seconds_by_tokens: dict[int, float]) -> None:
        self.table = seconds_by_tokens

    def predict(self, sums: BatchSums) -> float:
        return self.table[sums.num_new_tokens]


def test_time_already_spent_guessing_counts_in_every_choice():
    """Verification alone: two drafts beat three (2.9 tokens in 50 ms vs 3.8 in 70). With a
    draft model's 54 ms of guessing already spent either way, verifying all three wins."""
    cost = TableCost({1: 0.037, 2: 0.044, 3: 0.050, 4: 0.070})
    scheduler, (request,) = adaptive_scheduler(cost, 1)
    request.spec_token_ids = [1, 2, 3]
    request.recent_accepted, request.recent_rejections = 100.0, 2.0
    assert len(scheduler.schedule().scheduled[0].draft_token_ids) == 2
    scheduler, (request,) = adaptive_scheduler(cost, 1)
    request.spec_token_ids = [1, 2, 3]
    request.recent_accepted, request.recent_rejections = 100.0, 2.0
    scheduler.proposal_seconds = 0.054
    assert len(scheduler.schedule().scheduled[0].draft_token_ids) == 3


def test_a_costly_proposer_guesses_only_where_its_cost_leaves_a_gain():
    """Before a draft model guesses, the engine asks whether drafts at its forecast cost could
    pay were all accepted. One request, a step of 10 + 1 per token: 4 drafts emit 5 tokens in
    15 against 1 in 11, so guessing may cost up to ~37 (5 / (15 + s) must beat 1.05 / 11).
    Guessing is not spent yet, so verifying none does not pay it. A low acceptance estimate
    does not stop the guesses (only verified drafts would ever raise it again)."""
    scheduler, requests = adaptive_scheduler(LinearCost(10.0, 1.0), 1)
    requests[0].recent_rejections = 100.0
    assert scheduler.drafts_may_pay(requests, [4], 30.0)
    assert not scheduler.drafts_may_pay(requests, [4], 40.0)
    assert not scheduler.drafts_may_pay(requests, [0], 0.0)  # nothing to verify
    # 32 requests share the step's constant: 160 tokens in 170 against 32 in 42 pays for
    # guessing only up to ~30.
    scheduler, requests = adaptive_scheduler(LinearCost(10.0, 1.0), 32)
    assert scheduler.drafts_may_pay(requests, [4] * 32, 25.0)
    assert not scheduler.drafts_may_pay(requests, [4] * 32, 35.0)
