"""The measured check on speculation: per batch size, it turns drafts off where steps with them
deliver fewer tokens per second than steps without, keeps exploring both, and lets them be
where they pay."""

from tandem.core.spec_guard import EXPLORE_EVERY, SpeculationGuard, batch_bucket


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


def test_turns_speculation_off_where_it_loses_and_keeps_checking():
    guard = SpeculationGuard()
    allowed = run(guard, 64, 200, rate_with=480, rate_without=500)
    exploring = [(step + 1) % EXPLORE_EVERY == 0 for step in range(100, 200)]
    assert allowed[100:] == exploring  # only the exploring steps speculate
    assert guard.verdicts()[batch_bucket(64)] == (480, 500)


def test_keeps_speculation_where_it_pays():
    guard = SpeculationGuard()
    allowed = run(guard, 1, 200, rate_with=60, rate_without=40)
    exploring = [(step + 1) % EXPLORE_EVERY == 0 for step in range(100, 200)]
    assert allowed[100:] == [not e for e in exploring]  # plain only to re-measure


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
