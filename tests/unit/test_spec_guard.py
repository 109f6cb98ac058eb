"""The measured check on speculation: per batch size, it turns drafts off where steps with them
deliver fewer tokens per second than steps without, keeps exploring both, and lets them be
where they pay."""

import random
from itertools import pairwise

from tandem.core.spec_guard import (
    EXPLORE_EVERY,
    LEARN_EVERY,
    MAX_EXPLORE_EVERY,
    MIN_STEPS,
    SpeculationGuard,
    batch_bucket,
)


def run(guard: SpeculationGuard, num_decodes: int, steps: int, rate_with: float,
        rate_without: float) -> list[bool]:  # fmt: skip
    """Steps of a machine where drafts give `rate_with` tokens/s and plain steps
    `rate_without`; returns what the guard allowed at each."""
    allowed = []
    for _ in range(steps):
        speculate = guard.allows(num_decodes)
        allowed.append(speculate)
        guard.observe(num_decodes, speculate, int(rate_with if speculate else rate_without), 1.0)
    return allowed


def gaps(steps: list[int]) -> list[int]:
    return [b - a for a, b in pairwise(steps)]


def test_turns_speculation_off_where_it_loses_and_checks_ever_less_often():
    guard = SpeculationGuard()
    allowed = run(guard, 64, 600, rate_with=350, rate_without=500)
    speculated = [step for step, allow in enumerate(allowed) if allow]
    # Once both kinds are measured, each exploring step that confirms the verdict doubles the
    # interval to the next.
    explored = [gap for gap in gaps(speculated) if gap > 2]
    assert explored[1:4] == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, MAX_EXPLORE_EVERY]
    assert set(explored[3:]) == {MAX_EXPLORE_EVERY}
    assert guard.verdicts()[batch_bucket(64)] == (350, 500)


def test_a_close_verdict_keeps_exploring_every_few_steps():
    """Drafts 4% slower: off, but a noisy measure this close is checked every EXPLORE_EVERY
    steps."""
    guard = SpeculationGuard()
    allowed = run(guard, 64, 300, rate_with=480, rate_without=500)
    explored = [step for step in range(100, 300) if allowed[step]]
    assert gaps(explored) == [EXPLORE_EVERY] * (len(explored) - 1)
    assert len(explored) >= 200 // EXPLORE_EVERY


def test_keeps_speculation_where_it_pays_and_rechecks_ever_less_often():
    guard = SpeculationGuard()
    allowed = run(guard, 1, 600, rate_with=60, rate_without=40)
    plain = [step for step, allow in enumerate(allowed) if not allow]
    learning, exploring = gaps(plain)[: MIN_STEPS - 1], gaps(plain)[MIN_STEPS - 1 :]
    assert learning == [LEARN_EVERY] * (MIN_STEPS - 1)
    assert exploring == sorted(exploring) and exploring[-5:] == [MAX_EXPLORE_EVERY] * 5
    assert exploring[0] == EXPLORE_EVERY


def test_a_verdict_that_flips_brings_exploration_back():
    """Drafts lose by 30% long enough for exploring to be rare; then the machine changes and
    they pay: the moving average takes a few exploring steps to cross (each closer one comes
    sooner), and from the flip on speculation runs, re-checked ever less often."""
    guard = SpeculationGuard()
    run(guard, 8, 600, rate_with=350, rate_without=500)
    allowed = run(guard, 8, 260, rate_with=700, rate_without=500)
    assert allowed.index(True) < MAX_EXPLORE_EVERY  # the first exploring step
    assert all(allowed[2 * MAX_EXPLORE_EVERY + EXPLORE_EVERY :][: EXPLORE_EVERY - 1])
    assert sum(allowed[-MAX_EXPLORE_EVERY:]) >= MAX_EXPLORE_EVERY - 2
    with_drafts, without = guard.verdicts()[batch_bucket(8)]
    assert with_drafts > without


def test_batch_sizes_have_their_own_verdicts():
    guard = SpeculationGuard()
    run(guard, 64, 100, rate_with=480, rate_without=500)
    run(guard, 2, 100, rate_with=60, rate_without=40)
    assert not guard.allows(70)  # same bucket as 64 (64-127), not an exploring step
    assert guard.allows(3)
    assert batch_bucket(1) != batch_bucket(2) == batch_bucket(3) != batch_bucket(4)


def test_greedy_batches_have_their_own_verdicts():
    """Sampled requests accept fewer drafts: a verdict against drafts made on them (say, a
    warm-up) leaves a batch of greedy requests unmeasured, so the step-cost model decides
    there until the greedy batches' own rates say otherwise."""
    guard = SpeculationGuard()
    run(guard, 8, 100, rate_with=220, rate_without=410)
    assert not guard.allows(8) and not guard.peek(8)
    assert guard.peek(8, greedy=True) and guard.allows(8, greedy=True)
    for _ in range(50):
        speculate = guard.allows(8, greedy=True)
        guard.observe(8, speculate, 470 if speculate else 410, 1.0, greedy=True)
    assert guard.verdicts()[batch_bucket(8, greedy=True)] == (470, 410)
    assert guard.verdicts()[batch_bucket(8)][0] < 410


def test_prefers_the_cost_model_until_both_kinds_are_measured():
    guard = SpeculationGuard()
    allowed = run(guard, 8, EXPLORE_EVERY * 3, rate_with=100, rate_without=100)
    # Until three plain steps are measured, every LEARN_EVERY-th step is one; the others are
    # the step-cost model's to decide.
    learning = MIN_STEPS * LEARN_EVERY
    assert allowed[:learning] == [(step + 1) % LEARN_EVERY != 0 for step in range(learning)]


def test_peek_tells_what_the_next_step_will_be_allowed():
    guard = SpeculationGuard()
    assert guard.peek(64)  # nothing measured: let it try
    for step in range(100):
        expected = guard.peek(64)
        assert guard.allows(64) is expected, step
        guard.observe(64, expected, 480 if expected else 500, 1.0)


def test_a_step_observed_without_asking_explores_nothing():
    """A decode step the guard was not asked about (its planning preempted before drafts) is
    measured, but is not an exploring step: the interval to the next exploring step doubles
    once per exploring step, not again for the plain step observed after it."""
    guard = SpeculationGuard()
    run(guard, 8, 40, rate_with=700, rate_without=500)  # drafts pay by 40%: decisive

    def steps_to_next_plain() -> int:
        count = 0
        while guard.allows(8):
            guard.observe(8, True, 700, 1.0)
            count += 1
        guard.observe(8, False, 500, 1.0)  # the exploring step
        return count

    steps_to_next_plain()
    before = steps_to_next_plain()
    guard.observe(8, False, 500, 1.0)  # observed, never asked
    assert steps_to_next_plain() + 1 == min(2 * (before + 1), MAX_EXPLORE_EVERY)


def test_a_guard_that_explores_no_refusals_still_explores_where_drafts_pay():
    """For a draft model (an exploring guess first catches up on every token since its last),
    a batch size where drafts lost is not explored again; one where they pay still gets its
    plain steps, which cost little."""
    guard = SpeculationGuard(explores_refusals=False)
    losing = run(guard, 8, 300, rate_with=350, rate_without=500)
    learned = MIN_STEPS * LEARN_EVERY
    assert any(losing[:learned]) and not any(losing[learned:])
    assert guard.verdicts()[batch_bucket(8)] == (350, 500)
    paying = run(guard, 1, 300, rate_with=60, rate_without=40)
    plain = [step for step, allow in enumerate(paying) if not allow]
    assert len(plain) > MIN_STEPS and plain[-1] > 150  # still measured now and then


def test_a_batch_sizes_first_steps_with_drafts_probe():
    """Until MIN_STEPS of its steps verified drafts, a batch size's steps that may verify
    them probe (verify them as if all would be accepted): the acceptance estimates learn only
    from drafts verified. A costly proposer's guard never probes."""
    guard = SpeculationGuard()
    probed = []
    for _ in range(4 * MIN_STEPS):
        speculate = guard.allows(1)
        probed.append(guard.probing)
        assert not guard.probing or speculate
        guard.observe(1, speculate, 600 if speculate else 500, 1.0)
    assert sum(probed) == MIN_STEPS and probed[0]
    costly = SpeculationGuard(explores_refusals=False)
    assert costly.allows(1) and not costly.probing


def test_an_exploring_step_probes_where_the_steps_went_plain():
    """Drafts pay here, but from some step on the acceptance estimates keep every step plain:
    once an exploring step's interval has passed without drafts, exploring steps verify
    drafts (probes), not one more plain step each."""
    guard = SpeculationGuard()
    run(guard, 8, 40, rate_with=700, rate_without=500)
    explored = []
    for _ in range(4 * MAX_EXPLORE_EVERY):
        allowed = guard.allows(8)
        if not allowed or guard.probing:
            explored.append("probe" if guard.probing else "plain")
        guard.observe(8, False, 500, 1.0)  # the estimates verified none
    assert explored[0] == "plain" and set(explored[1:]) == {"probe"}
    # Where the steps verify drafts, an exploring step is a plain one, as before.
    allowed = run(guard, 8, 2 * MAX_EXPLORE_EVERY, rate_with=700, rate_without=500)
    assert not all(allowed)


def test_noisy_drafts_keep_the_benefit_of_the_doubt():
    """At batch 1 a step verifying n-gram drafts emits 1 token or 6 (rates of 200 or 1,200
    against 480 for plain steps, 700 on average): a few rejections in a row must not keep
    drafts off. Steady drafts that lose by as much are still refused."""

    def share_allowed(rates_with: list[float]) -> float:
        guard = SpeculationGuard(min_gain=0.05)
        draws = random.Random(0)
        allowed = 0
        for _ in range(600):
            speculate = guard.allows(1)
            allowed += speculate
            rate = draws.choice(rates_with) if speculate else 480
            guard.observe(1, speculate, rate, 1.0)
        return allowed / 600

    assert share_allowed([200, 1200]) > 0.8
    assert share_allowed([360]) < 0.1
    assert share_allowed([100, 400]) < 0.2


def test_a_costly_proposers_verdict_stands_as_measured():
    """Noisy drafts averaging 463 tokens/s against 480 plain: the doubt lets a cheap
    proposer's drafts on; a costly proposer's verdict takes the average as it is."""
    for explores_refusals in (True, False):
        guard = SpeculationGuard(min_gain=0.05, explores_refusals=explores_refusals)
        for _ in range(MIN_STEPS):
            guard.observe(1, False, 480, 1.0)
        for rate in [900, 100] * 5 + [300]:
            guard.observe(1, True, rate, 1.0)
        assert round(guard.verdicts()[batch_bucket(1)][0]) == 463
        assert guard.peek(1) is explores_refusals
