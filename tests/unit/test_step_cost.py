"""The step-cost model recovers known coefficients from synthetic step timings, and the
ITL-targeted scheduler, under a fake cost model, never plans a step over the target when the
decodes alone fit, still finishes every prompt when they do not, and leaves outputs unchanged."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

import numpy as np
import pytest
from test_scheduler import add, make_scheduler, run_to_completion, step

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.roofline import BatchSums, MachinePeaks, ModelShape, batch_sums, request_sums
from tandem.core.scheduler import MIN_PREFILL_TOKENS, Scheduler, SchedulerConfig
from tandem.core.step_cost import HEADROOM_MAX, StepCostModel

SHAPE = ModelShape(30, 576, 1536, 9, 3, 64, 49152, 4, 4, 4)
PEAKS = MachinePeaks("test", 200e9, 20e9)
# seconds = constant + per new token + per attended position + per KV position + per sample
TRUE = np.array([2e-3, 1.5e-4, 2e-8, 3e-7, 5e-5])


def true_seconds(sums: BatchSums) -> float:
    values = (1, sums.num_new_tokens, sums.num_attended, sums.num_context, sums.num_sampled)
    return float(np.dot(TRUE, values))


def random_step(rng: random.Random) -> BatchSums:
    """A realistic mix: some decodes over varied contexts, sometimes a prompt chunk."""
    sums = BatchSums()
    for _ in range(rng.randint(0, 16)):
        sums += request_sums(rng.randint(10, 2000), 1, True)
    if rng.random() < 0.5:
        chunk = rng.randint(16, 512)
        sums += request_sums(rng.randint(0, 1000), chunk, rng.random() < 0.5)
    return sums if sums.num_new_tokens else request_sums(0, 32, True)


def packed_model(packed_max_tokens: int) -> StepCostModel:
    """A model whose steps of up to `packed_max_tokens` tokens multiply packed weights."""
    shape = ModelShape(30, 576, 1536, 9, 3, 64, 49152, 2, 2, 2, packed_weights=10**8,
                       packed_bytes=6 * 10**7, packed_max_tokens=packed_max_tokens)  # fmt: skip
    return StepCostModel(shape, PEAKS, min_steps=8, refit_every=8)


def assert_learns(
    model: StepCostModel,
    seconds: Callable[[int], float],
    observed: Iterable[int],
    checked: Iterable[int],
    rel: float,
) -> None:
    """Steps of one request with the `observed` token counts, timed by `seconds`, teach the
    model; then its forecasts of the `checked` counts must be within `rel`."""
    for tokens in observed:
        model.observe(request_sums(0, tokens, True), seconds(tokens))
    for tokens in checked:
        predicted = model.predict(request_sums(0, tokens, True))
        assert predicted == pytest.approx(seconds(tokens), rel=rel), tokens


def test_learns_the_two_regimes_of_packed_weights():
    """Steps of up to 8 tokens multiply packed weights (cheap to read, each row costly), larger
    ones dense weights (more bytes, rows nearly free): the model predicts both, and the jump
    between them, once it has seen steps of each kind."""

    def seconds(tokens: int) -> float:
        return 0.015 + 0.004 * tokens if tokens <= 8 else 0.040 + 0.0003 * tokens

    rng = random.Random(1)
    observed = [rng.choice([1, 2, 3, 5, 8, 9, 16, 64, 256]) for _ in range(200)]
    assert_learns(packed_model(8), seconds, observed, (1, 6, 8, 9, 12, 200), rel=0.02)


def test_learns_a_staircase_in_small_steps():
    """A kernel that takes rows four at a time: 1-4 tokens cost the same, 5-8 more. The line
    cannot follow it; the per-count residuals do."""
    model = StepCostModel(SHAPE, PEAKS, min_steps=8, refit_every=8)

    def seconds(tokens: int) -> float:
        return 0.010 + 0.008 * ((tokens + 3) // 4) + 0.0001 * tokens

    rng = random.Random(2)
    for _ in range(300):
        tokens = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 100, 300])
        model.observe(request_sums(50, tokens, True), seconds(tokens))
    for tokens in (1, 4, 5, 8):
        predicted = model.predict(request_sums(50, tokens, True))
        assert predicted == pytest.approx(seconds(tokens), rel=0.03), tokens


def test_roofline_predicts_until_fitted():
    model = StepCostModel(SHAPE, PEAKS, min_steps=32, refit_every=16)
    sums = request_sums(0, 256, True)
    assert model.coefficients is None
    assert model.predict(sums) == pytest.approx(model.roofline_seconds(sums))
    assert model.roofline_seconds(sums) > 0
    # the least time the roofline leaves unexplained is added as per-step overhead
    decode = request_sums(100, 1, True)
    model.observe(decode, model.roofline_seconds(decode) + 0.004)
    model.observe(sums, model.roofline_seconds(sums) + 0.003)
    assert model.predict(decode) == pytest.approx(model.roofline_seconds(decode) + 0.003)


def test_recovers_known_coefficients_from_noisy_timings():
    rng = random.Random(0)
    noise = np.random.default_rng(0)
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=32, refit_every=16)
    for _ in range(512):
        sums = random_step(rng)
        model.observe(sums, true_seconds(sums) * (1 + 0.02 * noise.standard_normal()))
    assert model.coefficients is not None
    errors = []
    for _ in range(200):
        sums = random_step(rng)
        errors.append(abs(model.predict(sums) - true_seconds(sums)) / true_seconds(sums))
    assert np.median(errors) < 0.03 and np.quantile(errors, 0.9) < 0.06
    # the two big terms come back within a few percent
    assert model.coefficients[1] == pytest.approx(TRUE[1], rel=0.05)
    assert model.coefficients[0] == pytest.approx(TRUE[0], rel=0.15)


def test_tells_a_bursts_forwards_from_a_lone_step():
    """Multi-step bursts share their step's own work (scheduling, outputs: ~0.2 ms beside a
    ~2 ms forward here) among their forwards, which a lone decode step pays alone: the model
    forecasts lone steps within 2% and bursts of any length within 4% (one ratio serves every
    burst length, so its error grows with that share). With one ratio for both kinds, lone
    steps came out ~5% short here."""
    model = StepCostModel(SHAPE, PEAKS, min_steps=8, refit_every=8)

    def seconds(sums: BatchSums, num_steps: int) -> float:
        return 0.0002 + num_steps * (0.0020 + 1e-7 * sums.num_attended)

    rng = random.Random(3)
    for _ in range(300):
        sums = request_sums(rng.randint(50, 1500), 1, True)
        num_steps = rng.choice([1, 1, 2, 3, 5])
        model.observe(sums, seconds(sums, num_steps), num_steps=num_steps)
    for num_steps, tolerance in ((1, 0.02), (2, 0.04), (4, 0.04), (6, 0.04)):
        sums = request_sums(700, 1, True)
        predicted = model.predict(sums, num_steps)
        assert predicted == pytest.approx(seconds(sums, num_steps), rel=tolerance), num_steps


def test_follows_a_machine_that_slows_down():
    rng = random.Random(1)
    model = StepCostModel(SHAPE, PEAKS, window=128, min_steps=32, refit_every=8)
    for factor in (1.0, 3.0):
        for _ in range(256):
            sums = random_step(rng)
            model.observe(sums, factor * true_seconds(sums))
    sums = random_step(rng)
    assert model.predict(sums) == pytest.approx(3 * true_seconds(sums), rel=0.05)


def test_small_steps_follow_a_slowdown_within_a_few_steps():
    """Decode steps of one token count on a machine that turns 30% slower: the per-count
    ratio catches up within four steps, long before the window's refits would."""
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=32, refit_every=16)
    contexts = [100 + 7 * index for index in range(300)]
    for context in contexts[:290]:
        sums = request_sums(context, 1, True) + request_sums(context + 50, 1, True)
        model.observe(sums, true_seconds(sums))
    for context in contexts[290:294]:
        sums = request_sums(context, 1, True) + request_sums(context + 50, 1, True)
        model.observe(sums, 1.3 * true_seconds(sums))
    sums = request_sums(contexts[294], 1, True) + request_sums(contexts[294] + 50, 1, True)
    assert model.predict(sums) == pytest.approx(1.3 * true_seconds(sums), rel=0.05)


def test_a_run_of_long_prompt_chunks_is_learned_as_it_comes():
    """A window of decode steps and short fresh prompts, then a long prompt in chunks of 144
    tokens, each attending to more of its own prefix, where attention costs far more per
    position than in the steps the window holds (a prompt chunk's attention is another kernel
    than a decode's): a chunk the forecast missed by more than 10% refits the line at once,
    so from the fourth chunk on the forecasts are within 10% (the chunk sizes a time target
    picks depend on them), where periodic refits alone would still be 24 steps away."""
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=32, refit_every=16)
    rng = random.Random(3)

    def seconds(sums: BatchSums, prompt_attended: int = 0) -> float:
        return 2e-3 + 1e-3 * sums.num_new_tokens + 1e-8 * sums.num_attended + 2e-6 * prompt_attended

    for index in range(192):
        if index % 16 == 0:
            sums = request_sums(0, 32, True)  # a short fresh prompt
            model.observe(sums, seconds(sums, sums.num_attended))
            continue
        sums = BatchSums()
        for _ in range(8):
            sums += request_sums(rng.randint(100, 400), 1, True)
        model.observe(sums, seconds(sums))
    errors = []
    for chunk in range(8):
        sums = request_sums(144 * chunk, 144, False)
        truth = seconds(sums, sums.num_attended)
        errors.append(abs(model.predict(sums) - truth) / truth)
        model.observe(sums, truth)
    assert max(errors[3:]) < 0.10, errors


def test_no_coefficient_is_negative_even_when_a_feature_never_varies():
    model = StepCostModel(SHAPE, PEAKS, min_steps=8, refit_every=8)
    for context in range(8, 200, 8):  # decodes only: new tokens == sampled rows, collinear
        sums = request_sums(context, 1, True) + request_sums(context + 3, 1, True)
        model.observe(sums, 1e-3 + 2e-6 * context)
    assert model.coefficients is not None and all(c >= 0 for c in model.coefficients)


# -- the scheduler with a target ------------------------------------------------------------


class FakeCost:
    """A known linear cost: 10 ms per step, 1 ms per new token, 0.01 ms per KV position."""

    packed_max_tokens = 0

    def __init__(self, headroom: float = 0.0, max_observed_tokens: int = 10**6) -> None:
        self.headroom = headroom
        self.max_observed_tokens = max_observed_tokens

    def predict(self, sums: BatchSums) -> float:
        return 0.010 + 0.001 * sums.num_new_tokens + 0.00001 * sums.num_context


def targeted(target: float, cost: FakeCost | None = None) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512, target_step_time=target
    )
    return Scheduler(config, KVCacheManager(512, 4, False), cost_model=cost or FakeCost())


def test_config_needs_a_cost_model_and_decode_first():
    with pytest.raises(ValueError, match="step-cost model"):
        make_scheduler(target_step_time=0.05)
    with pytest.raises(ValueError, match="decode-first"):
        SchedulerConfig(target_step_time=0.05, batching_policy="prefill-first")
    with pytest.raises(ValueError, match="positive"):
        SchedulerConfig(target_step_time=0.0)


def test_steps_stay_within_the_target_when_decodes_fit():
    """Eight streams decoding; long prompts arrive: every step's predicted time is within the
    target (50 ms: 10 ms + 8 decodes leave room for ~30 prompt tokens), and prompts still run."""
    scheduler = targeted(0.050)
    for index in range(8):
        add(scheduler, f"stream{index}", 8, max_tokens=60, ignore_eos=True)
    for _ in range(3):
        step(scheduler)
    add(scheduler, "long1", 300, max_tokens=2, ignore_eos=True)
    add(scheduler, "long2", 200, max_tokens=2, ignore_eos=True)
    outputs = run_to_completion(scheduler)
    cost = FakeCost()
    for output in outputs:
        predicted = cost.predict(batch_sums(output.scheduled))
        decodes = [s for s in output.scheduled if s.num_new_tokens == 1 and s.sample]
        if cost.predict(batch_sums(decodes)) <= 0.050:
            assert predicted <= 0.050 + 1e-12, (predicted, output.num_prefill_tokens)
    prefill_steps = [o for o in outputs if o.num_prefill_tokens]
    assert max(o.num_prefill_tokens for o in prefill_steps) > 16  # the room is used


def test_headroom_is_the_recent_overrun_of_larger_steps_capped():
    """Larger steps that run 25% over their forecast give a headroom of about 0.25; steps far
    over it do not shrink every later chunk to nothing (at most HEADROOM_MAX)."""
    model = StepCostModel(SHAPE, PEAKS, min_steps=8, refit_every=8)
    rng = random.Random(4)
    for _ in range(64):
        sums = random_step(rng)
        model.observe(sums, true_seconds(sums))
    assert model.headroom < 0.05
    for _ in range(16):
        sums = request_sums(rng.randint(0, 500), 256, True)
        model.observe(sums, 1.25 * model.predict(sums))
    assert model.headroom == pytest.approx(0.25, abs=0.02)
    for _ in range(16):
        sums = request_sums(rng.randint(0, 500), 256, True)
        model.observe(sums, 3 * model.predict(sums))
    assert model.headroom == HEADROOM_MAX


def test_target_plans_within_the_headroom_and_grows_chunks_gradually():
    """With a headroom of 0.25 every planned step's forecast stays within target / 1.25; with a
    model that has seen steps of at most 20 tokens, no step takes more than 40."""
    for cost, bound, most_tokens in ((FakeCost(headroom=0.25), 0.050 / 1.25, None),
                                     (FakeCost(max_observed_tokens=20), 0.050, 40)):  # fmt: skip
        scheduler = targeted(0.050, cost)
        for index in range(4):
            add(scheduler, f"stream{index}", 8, max_tokens=40, ignore_eos=True)
        step(scheduler)
        add(scheduler, "long", 300, max_tokens=2, ignore_eos=True)
        outputs = run_to_completion(scheduler)
        for output in outputs:
            if output.num_prefill_tokens > MIN_PREFILL_TOKENS:
                assert cost.predict(batch_sums(output.scheduled)) <= bound + 1e-12
            if most_tokens is not None:
                assert output.total_num_scheduled_tokens <= most_tokens


def test_prompts_progress_when_decodes_alone_exceed_the_target():
    """A 15 ms target with eight decodes (predicted ~18 ms): each step still takes a small
    prompt chunk, so the long prompt finishes."""
    scheduler = targeted(0.015)
    for index in range(8):
        add(scheduler, f"stream{index}", 8, max_tokens=200, ignore_eos=True)
    step(scheduler)
    long_prompt = add(scheduler, "long", 100, max_tokens=1, ignore_eos=True)
    outputs = run_to_completion(scheduler)
    chunks = [s.num_new_tokens for o in outputs for s in o.scheduled if s.request_id == "long"]
    assert chunks == [MIN_PREFILL_TOKENS] * 6 + [100 - 6 * MIN_PREFILL_TOKENS]
    assert long_prompt.num_output_tokens == 1


def test_a_forced_chunk_takes_what_the_target_itself_allows():
    """Decodes alone over the planning target (24 ms less a headroom of 0.5: 16 ms) but under
    the target itself: the prompt still progresses every step, by as many tokens as keep the
    step within the target (a few), not a fixed MIN_PREFILL_TOKENS that would overrun it."""
    cost = FakeCost(headroom=0.5)
    scheduler = targeted(0.024, cost)
    for index in range(8):
        add(scheduler, f"stream{index}", 8, max_tokens=100, ignore_eos=True)
    step(scheduler)
    long_prompt = add(scheduler, "long", 60, max_tokens=1, ignore_eos=True)
    outputs = run_to_completion(scheduler)
    chunks = []
    for output in outputs:
        for scheduled in output.scheduled:
            if scheduled.request_id == "long" and scheduled.num_new_tokens > 0:
                chunks.append(scheduled.num_new_tokens)
                assert cost.predict(batch_sums(output.scheduled)) <= 0.024 + 1e-12
    assert sum(chunks) == 60 and long_prompt.num_output_tokens == 1
    assert max(chunks) < MIN_PREFILL_TOKENS and min(chunks[:-1]) > 1, chunks


def test_target_changes_steps_not_outputs():
    """Batching invariance: the same tokens with and without a target."""

    def run(target: float | None) -> dict[str, list[int]]:
        scheduler = targeted(target) if target else make_scheduler(
            num_blocks=512, block_size=4, max_num_batched_tokens=256, max_num_seqs=16,
            max_model_len=256,
        )  # fmt: skip
        requests = [add(scheduler, f"r{i}", 20 + 37 * i, max_tokens=12) for i in range(6)]
        run_to_completion(scheduler)
        return {r.request_id: r.output_token_ids for r in requests}

    assert run(0.030) == run(None)


def test_refits_every_4_then_16_then_an_eighth_of_the_window():
    """Decode steps only (no prompt step misses far and refits at once): a fit at 8 steps, then
    every 4 up to 64 steps in the window, every 16 up to 136, then every window // 8 (64 once
    the 512-step window is full)."""
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=8, refit_every=16)
    fitted_at = []
    fit = model._fit

    def counted() -> None:
        fitted_at.append(model._num_observed)
        fit()

    model._fit = counted
    for context in range(1000):
        sums = request_sums(100 + context, 1, True)
        model.observe(sums, true_seconds(sums))
    gaps = {at: after - at for at, after in itertools.pairwise(fitted_at)}
    assert fitted_at[:14] == list(range(8, 64, 4))
    assert {gaps[at] for at in fitted_at if 64 <= at < 120} == {16}
    assert {gaps[at] for at in fitted_at[:-1] if at >= 512} == {64}


def test_prompts_take_whole_chunks_while_the_step_samples_nothing():
    """The target keeps the gaps of requests waiting for a token; a step that samples none
    keeps nobody waiting, so a lone prompt goes in chunks of its full per-request limit (128
    of the 256 budget) however long the forecast says they take (~140 ms against 50). Its last
    chunk samples its first token: the next prompt's chunk is then sized by the target (none
    fits: the first token does not wait for it), and beside the new decode after that."""
    scheduler = targeted(0.050)
    add(scheduler, "long", 300, max_tokens=3, ignore_eos=True)
    add(scheduler, "next", 300, max_tokens=1, ignore_eos=True)  # one prompt mid-prefill at a time
    outputs = [step(scheduler) for _ in range(4)]
    assert [o.num_prefill_tokens for o in outputs[:3]] == [128, 128, 44]
    assert FakeCost().predict(batch_sums(outputs[0].scheduled)) > 0.050
    beside = outputs[3]
    assert beside.num_decode_tokens == 1
    assert FakeCost().predict(batch_sums(beside.scheduled)) <= 0.050 + 1e-12
    assert 0 < beside.num_prefill_tokens < 128


def test_learns_packed_rows_cheaper_than_dense_ones():
    """A draft model's regimes: its packed steps' rows cost less than its dense steps' (bf16
    prefill), which a packed surcharge on one per-token cost cannot say. A few dense catch-ups
    among many packed steps must not price the packed rows at the dense rate."""

    def seconds(tokens: int) -> float:
        return 0.002 + (0.0006 if tokens <= 256 else 0.00105) * tokens

    rng = random.Random(3)
    observed = [1568 if index % 40 == 0 else rng.choice([8, 16, 24, 32, 100, 200])
                for index in range(120)]  # fmt: skip
    assert_learns(packed_model(256), seconds, observed, (8, 32, 150, 256, 400, 1568), rel=0.05)


def test_a_regime_not_seen_is_priced_as_the_other():
    """Only packed steps seen: a dense step's rows cost what packed rows do, not nothing."""

    def seconds(tokens: int) -> float:
        return 0.003 + 0.0005 * tokens

    observed = [2, 40, 9, 33, 17, 64, 5, 50] * 4
    assert_learns(packed_model(64), seconds, observed, (10, 64, 400), rel=0.05)


def test_small_steps_are_forecast_from_the_small_steps_in_the_window():
    """A window of batch 8-64 decodes and long prompt chunks, whose rows cost another
    kernel's rate (1.6 ms a token from a lower base, against a decode row's 0.6 ms on top of
    3.7 ms), then batch-1 steps: the 1-token steps and a verification of 6 tokens are forecast
    within 10% from the window's small steps. One line over the whole window priced a row at
    1.5 ms and forecast the verification 45% long (the 1-token steps, whose ratio to the line
    it had learned, within 2%): drafts looked dearer than they are, as on the Zen 4 EPYC after
    spec_decode.py's larger batches (BENCHMARKS.md)."""
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=8, refit_every=16)
    rng = random.Random(5)

    def seconds(sums: BatchSums) -> float:
        beyond = sums.num_attended - sums.num_context  # the pairs past one read of the KV
        kv = 2e-6 * sums.num_context + 3e-7 * beyond
        if sums.num_new_tokens > 64:
            return -0.030 + 1.6e-3 * sums.num_new_tokens + kv
        return 3.7e-3 + 0.6e-3 * sums.num_new_tokens + kv

    for index in range(480):
        if index % 12 == 0:
            sums = request_sums(rng.randint(0, 300), rng.randint(100, 600), True)
        else:
            sums = BatchSums()
            for _ in range(rng.choice([8, 32, 64])):
                sums += request_sums(rng.randint(100, 1500), 1, True)
        model.observe(sums, seconds(sums))
    for context in range(200, 232):  # a batch-1 stream starts: its bursts and lone steps
        sums = request_sums(context, 1, True)
        model.observe(sums, seconds(sums), num_steps=1 + context % 2)
    for sums in (request_sums(300, 1, True), request_sums(300, 6, True, 5)):
        assert model.predict(sums) == pytest.approx(seconds(sums), rel=0.10), sums


def test_a_verification_reads_its_kv_once_however_many_tokens_it_verifies():
    """Decode steps of one token a request cannot tell the cost of reading a position's KV
    from that of a query attending to it (the two counts are equal); attention reads each
    request's KV once for all its new tokens, so the model prices the read per KV position
    and only the pairs beyond it as attended: a 6-token verification at a context of 1,000,
    after a window of decodes alone, is forecast within 10%, not as six reads of its KV."""
    model = StepCostModel(SHAPE, PEAKS, window=512, min_steps=8, refit_every=16)
    rng = random.Random(6)

    def seconds(sums: BatchSums) -> float:
        beyond = sums.num_attended - sums.num_context
        return 2e-3 + 0.6e-3 * sums.num_new_tokens + 2e-6 * sums.num_context + 5e-8 * beyond

    for _ in range(300):
        sums = BatchSums()
        for _ in range(rng.randint(1, 16)):
            sums += request_sums(rng.randint(200, 2000), 1, True)
        model.observe(sums, seconds(sums))
    verification = request_sums(1000, 6, True, 5)
    assert model.predict(verification) == pytest.approx(seconds(verification), rel=0.10)


def test_a_jump_to_dense_steps_waits_for_dense_steps_of_spread_sizes():
    """A draft model's window: packed steps of 1-64 tokens and three prefills of 1,152-1,568
    tokens on the dense weights, a few percent noisy (0.8 ms a token, no jump between the
    regimes). A line's intercept through so narrow a range is noise: fitted as the jump to
    dense steps, it had forecast a 600-token catch-up at 1.5x its time (a draft model's
    backlogs so looked too dear to guess for: BENCHMARKS.md). The jump waits for dense steps
    whose sizes span 2x; until then their rows carry it, and the catch-up is forecast within
    10%."""

    def seconds(tokens: int) -> float:
        return 0.0035 + (0.0006 if tokens <= 512 else 0.0008) * tokens

    model = packed_model(512)
    rng = random.Random(7)
    for index in range(200):
        tokens = (1152, 1400, 1568)[index // 70] if index % 70 == 69 else rng.randint(1, 64)
        noise = (1.06, 0.97, 0.94)[index // 70] if tokens > 512 else 1.0
        model.observe(request_sums(0, tokens, True), seconds(tokens) * noise)
    predicted = model.predict(request_sums(0, 600, False))
    assert predicted == pytest.approx(seconds(600), rel=0.10)
