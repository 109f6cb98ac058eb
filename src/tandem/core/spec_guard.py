"""A measured check on speculation: per batch size, the tokens per second that steps with
drafts and steps without them actually deliver. The step-cost model forecasts what drafts
would add to a step; where its forecast is a few percent off (on a 2-core CPU, a draft token
costs nearly what a decode token does at batch 32 and above), speculation can lose while
predicted to win. This guard turns it off for a batch size whose measured rate with drafts
does not beat the rate without, and keeps both measurements fresh: some steps of a batch
size go the other way, one in EXPLORE_EVERY at first; each such step that confirms a
decisive verdict (rates more than DECISIVE_GAP apart) doubles the interval to the next (up
to MAX_EXPLORE_EVERY), and a verdict that flips or comes close brings it back to
EXPLORE_EVERY. An exploring step costs what the verdict saves (at batch 8 on a 2-core CPU a
step verifying drafts gave ~0.7x the tokens/s of a plain one): one in 8 was ~4% of the
plain rate, one in 64 is ~0.5%; where the rates are close, exploring costs little and a
noisy verdict needs it. Except for a proposer that must catch up on every token since it last
guessed (a draft model): an exploring guess there first computes the draft's KV of all the
tokens since, so exploring a batch size where drafts lost costs the same share of the time at
any interval (the catch-up grows with it): ~10-30% of the plain rate on a 2-core CPU, where a
batch of 8 drafting at break-even explored every 8th step ran at 0.92x. Its guard
(`explores_refusals=False`) explores only batch sizes where drafts pay: plain steps there are
cheap.

An exploring step goes the other way from what the batch size's steps have been doing, and
one that goes to drafts probes: it verifies them as if all would be accepted (the scheduler
chooses with acceptance 1), and so do a batch size's first steps until MIN_STEPS of them
verified drafts. Drafts refused by the acceptance estimates rather than by the verdict leave
no trace otherwise: an estimate moves only with drafts verified, so one that starts low
never rises (greedy n-gram requests at batch 1 began at the even odds of no data, were
never worth their drafts at those odds, and verified none in 2.5 rounds of the benchmark,
where forcing them gave 1.16-1.31x).
"""

from __future__ import annotations

from dataclasses import dataclass

EXPLORE_EVERY = 8
MAX_EXPLORE_EVERY = 64
# Of the plain rate: a verdict this clear backs its exploring off. Exploring every
# EXPLORE_EVERY steps costs about gap / EXPLORE_EVERY: at 0.15, n-gram drafts ~13% slower
# than batch-8 bursts were explored every 8th step, a steady 2-3% (BENCHMARKS.md).
DECISIVE_GAP = 0.08
RATE_WEIGHT = 0.2  # of the newest step in a moving average of tokens per second
# The moving average's variance, as a share of its samples' (weights w: w / (2 - w)).
AVERAGE_VARIANCE_SHARE = RATE_WEIGHT / (2 - RATE_WEIGHT)
# Of the newest step in the moving variance of the rates with drafts: a longer memory than
# the average's, so that a run of rejections (the same low rate a few times) does not make a
# noisy rate look certain.
VARIANCE_WEIGHT = 0.05
# Drafts keep the benefit of the doubt: their rate counts this many standard errors (of the
# moving average) higher. A step's rate with drafts is noisy where few requests share it: at
# batch 1, a step verifying n-gram drafts gave 1 token or 6 in ~5 ms (200 or 1,200 tokens/s
# against ~480 for plain bursts), so a few rejections in a row held its average below the
# plain rate, and then only the rare exploring steps could bring it back. In a simulation of
# the guard on such steps (drafts 1.5x as fast as bursts on average), drafts were verified in
# ~44% of the steps, for 530 tokens/s against 725 verifying always; with the doubt, ~94%, for
# 684. Drafts that lose by ~20% or more are refused as before, and steps of many requests
# average their luck out: there a verdict stands as measured. Not for a costly proposer
# (SpeculationGuard._pays).
DOUBT = 2.0
MIN_STEPS = 3  # of each kind before a batch size's verdict counts
# Until then, every LEARN_EVERY-th step goes without drafts, so the plain rate is measured
# within a few steps (at EXPLORE_EVERY it took 24, and the step-cost model, weighing drafts
# against one plain forward where multi-step bursts were the real alternative, verified
# drafts in most of them: ~5% of a batch-8 run's first 128 tokens).
LEARN_EVERY = 2


@dataclass
class _Rates:
    """Moving averages of emitted tokens per second, with drafts and without."""

    with_drafts: float = 0.0
    without_drafts: float = 0.0
    with_variance: float = 0.0  # of the steps' rates with drafts, moving as their average
    steps_with: int = 0
    steps_without: int = 0
    steps_seen: int = 0
    explore_every: int = EXPLORE_EVERY
    next_explore: int = LEARN_EVERY  # the step (steps_seen) that goes the other way next
    exploring: bool = False  # the step `allows` last answered goes against the verdict
    # A step since the last exploring one, not itself exploring, verified drafts.
    verified_since_explore: bool = False

    @property
    def measured(self) -> bool:
        """Enough steps of each kind for a verdict."""
        return self.steps_with >= MIN_STEPS and self.steps_without >= MIN_STEPS

    def pays(self, min_gain: float, doubt: float) -> bool:
        """Whether drafts beat plain steps by `min_gain`, their rate counted `doubt` standard
        errors higher."""
        error = (AVERAGE_VARIANCE_SHARE * self.with_variance) ** 0.5
        return self.with_drafts + doubt * error > self.without_drafts * (1 + min_gain)

    @property
    def decisive(self) -> bool:
        return abs(self.with_drafts - self.without_drafts) > DECISIVE_GAP * self.without_drafts

    def observe(self, speculated: bool, rate: float) -> None:
        if speculated:
            if self.steps_with:
                deviation = rate - self.with_drafts
                self.with_variance = (1 - VARIANCE_WEIGHT) * (
                    self.with_variance + VARIANCE_WEIGHT * deviation**2
                )
            self.with_drafts = _average(self.with_drafts, rate, self.steps_with)
            self.steps_with += 1
        else:
            self.without_drafts = _average(self.without_drafts, rate, self.steps_without)
            self.steps_without += 1


def _average(previous: float, value: float, count: int) -> float:
    return value if count == 0 else previous + RATE_WEIGHT * (value - previous)


def batch_bucket(num_decodes: int, greedy: bool = False) -> tuple[int, bool]:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a verdict, apart for batches of greedy
    requests only: a greedy request accepts a draft that is its argmax, a sampled one with
    the target's probability of it, so their rates with drafts differ (a draft model's 0.98
    against ~0.5 here), and a verdict made on one kind held the other off (a sampled warm-up
    kept greedy batches of 8 from drafting where forcing drafts gave 1.16x)."""
    return num_decodes.bit_length(), greedy


class SpeculationGuard:
    def __init__(self, min_gain: float = 0.0, explores_refusals: bool = True) -> None:
        self.min_gain = min_gain
        # False for a costly proposer: no exploring step verifies drafts, none probes.
        self.explores_refusals = explores_refusals
        self._rates: dict[tuple[int, bool], _Rates] = {}
        # The step `allows` last let verify drafts probes: it verifies them as if all would
        # be accepted, whatever the acceptance estimates say.
        self.probing = False

    def allows(self, num_decodes: int, greedy: bool = False) -> bool:
        """Whether a step of this many decodes (`greedy`: all of greedy requests) may verify
        drafts (ask once per such step)."""
        rates = self._rates.setdefault(batch_bucket(num_decodes, greedy), _Rates())
        step = rates.steps_seen = rates.steps_seen + 1
        verdict = self._verdict(rates, step)
        explore = step >= rates.next_explore
        if explore:
            rates.next_explore = step + (rates.explore_every if rates.measured else LEARN_EVERY)
            rates.verified_since_explore = False
        rates.exploring = explore and rates.measured and self._explores(rates)
        self.probing = (
            verdict and self.explores_refusals and (rates.steps_with < MIN_STEPS or rates.exploring)
        )
        return verdict

    def peek(self, num_decodes: int, greedy: bool = False) -> bool:
        """What `allows` will say at the next step of this many decodes (whether a costly
        proposer should guess for it)."""
        rates = self._rates.get(batch_bucket(num_decodes, greedy))
        return rates is None or self._verdict(rates, rates.steps_seen + 1)

    def _verdict(self, rates: _Rates, step: int) -> bool:
        """The answer for the bucket's `step`-th step: an exploring one goes the other way."""
        explore = step >= rates.next_explore
        if not rates.measured:
            # Too few of one kind: let the step-cost model decide, but make sure plain steps
            # get measured too.
            return not (explore and rates.steps_without < MIN_STEPS)
        if explore and self._explores(rates):
            # The other way from what its steps have been doing since the last exploring
            # one: plain where some verified drafts, drafts where none did (refused by the
            # verdict or by the acceptance estimates), for a proposer whose exploring may
            # verify drafts. (The engine peeks before it observes the step it peeks after:
            # that step can only make the answer plain, so a peek never says plain where the
            # step will probe.)
            return self.explores_refusals and not rates.verified_since_explore
        return self._pays(rates)

    def _explores(self, rates: _Rates) -> bool:
        """Whether the bucket's steps explore (a costly proposer's only where drafts pay)."""
        return self.explores_refusals or self._pays(rates)

    def _pays(self, rates: _Rates) -> bool:
        """The bucket's verdict. Drafts keep the benefit of the doubt (DOUBT) only where
        refusals are explored: a costly proposer's verdict stands as measured (with the doubt,
        the draft model's batch-1 engine once never verified a draft, 0.80x, in a benchmark
        run; why was not established)."""
        return rates.pays(self.min_gain, DOUBT if self.explores_refusals else 0.0)

    def observe(
        self, num_decodes: int, speculated: bool, tokens: int, seconds: float, greedy: bool = False
    ) -> None:
        """A decode-only step's outcome: did it verify drafts, how many tokens it emitted."""
        if num_decodes and seconds > 0:
            rates = self._rates.setdefault(batch_bucket(num_decodes, greedy), _Rates())
            # The step `allows` last answered is this one (a step observed without asking
            # first, one whose planning preempted, explores nothing).
            exploring, rates.exploring = rates.exploring, False
            measured, paid = rates.measured, self._pays(rates)
            rates.observe(speculated, tokens / seconds)
            if speculated and not exploring:
                rates.verified_since_explore = True
            if rates.measured and not measured:  # learnt: exploring starts EXPLORE_EVERY on
                rates.next_explore = rates.steps_seen + rates.explore_every
            flipped = measured and self._pays(rates) != paid
            if flipped or (measured and not rates.decisive):
                if rates.explore_every > EXPLORE_EVERY:  # look again soon (not later than due)
                    rates.explore_every = EXPLORE_EVERY
                    rates.next_explore = min(rates.next_explore,
                                             rates.steps_seen + EXPLORE_EVERY)  # fmt: skip
            elif exploring and speculated != paid:  # went the other way, and confirmed
                rates.explore_every = min(2 * rates.explore_every, MAX_EXPLORE_EVERY)
                rates.next_explore = rates.steps_seen + rates.explore_every

    def verdicts(self) -> dict[tuple[int, bool], tuple[float, float]]:
        """Per bucket: measured tokens/s with and without drafts (for logs and benchmarks)."""
        return {b: (r.with_drafts, r.without_drafts) for b, r in sorted(self._rates.items())}
