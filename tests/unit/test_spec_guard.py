"""The measured check on speculation: per batch size, it turns drafts off where steps with them
deliver fewer tokens per second than steps without, keeps exploring both, and lets them be
where they pay."""

from itertools import pairwise

from tandem.core.spec_guard import (
    EXPLORE_EVERY,
    MAX_EXPLORE_EVERY,
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
    allowed = run(guard, 64, 600, rate_with=480, rate_without=500)
    speculated = [step for step, allow in enumerate(allowed) if allow]
    # Once both kinds are measured, each exploring step that confirms the verdict doubles the
    # interval to the next.
    explored = [gap for gap in gaps(speculated) if gap > 2]
    assert explored[1:4] == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY, MAX_EXPLORE_EVERY]
    assert set(explored[3:]) == {MAX_EXPLORE_EVERY}
    assert guard.verdicts()[batch_bucket(64)] == (480, 500)


def test_keeps_speculation_where_it_pays_and_rechecks_ever_less_often():
    guard = SpeculationGuard()
    allowed = run(guard, 1, 600, rate_with=60, rate_without=40)
    plain = [step for step, allow in enumerate(allowed) if not allow]
    assert gaps(plain) == sorted(gaps(plain)) and gaps(plain)[-5:] == [MAX_EXPLORE_EVERY] * 5
    assert gaps(plain)[0] == EXPLORE_EVERY


def test_a_verdict_that_flips_brings_exploration_back():
    """Drafts lose long enough for exploring to be rare; then the machine changes and they
    pay: the next exploring step flips the verdict, and speculation runs from then on."""
    guard = SpeculationGuard()
    run(guard, 8, 600, rate_with=480, rate_without=500)
    allowed = run(guard, 8, 200, rate_with=600, rate_without=500)
    first = allowed.index(True)
    assert first < MAX_EXPLORE_EVERY
    # From then on plain steps only to re-measure: every EXPLORE_EVERY steps, then rarer.
    assert len(allowed) - first - sum(allowed[first:]) <= len(allowed[first:]) // EXPLORE_EVERY
    with_drafts, without = guard.verdicts()[batch_bucket(8)]
    assert with_drafts > without


def test_batch_sizes_have_their_own_verdicts():
    guard = SpeculationGuard()
    run(guard, 64, 100, rate_with=480, rate_without=500)
    run(guard, 2, 100, rate_with=60, rate_without=40)
    assert not guard.allows(70)  # same bucket as 64 (64-127), not an exploring step
    assert guard.allows(3)
    assert batch_bucket(1) != batch_bucket(2) == batch_bucket(3) != batch_bucket(4)


def test_prefers_the_cost_model_until_both_kinds_are_measured():
    guard = SpeculationGuard()
    allowed = run(guard, 8, EXPLORE_EVERY * 3, rate_with=100, rate_without=100)
    # Plain steps are forced only at exploring steps until three are measured.
    assert allowed[EXPLORE_EVERY - 1] is False
    assert allowed[: EXPLORE_EVERY - 1] == [True] * (EXPLORE_EVERY - 1)


def test_peek_tells_what_the_next_step_will_be_allowed():
    guard = SpeculationGuard()
    assert guard.peek(64)  # nothing measured: let it try
    for step in range(100):
        expected = guard.peek(64)
        assert guard.allows(64) is expected, step
        guard.observe(64, expected, 480 if expected else 500, 1.0)
