"""What a step will cost, learned on the machine it runs on: step time as a linear function of the
batch's sums (core/roofline.py), time = c + a * new tokens + d * KV positions read + b * the
attended positions beyond that read + e * sampled rows, fitted by least squares over a window of
recent steps and refitted as steps come in (every 4 while the window is short, then every 16,
and once it is long, when an eighth of it is new), so it follows the machine and the load.
Attention reads each request's KV once for all its new tokens, so a position's read is priced
per KV position and only the pairs past it (a prompt chunk's, a verification's) as attended: a
decode token attends to exactly the positions it reads, so in a window of decodes the two counts
cannot be told apart, and a line on attended positions had priced a verification of k tokens as
k reads of its KV. Steps of up to SMALL_MAX_TOKENS tokens are forecast by a line fitted to the
window's steps of that size alone, once it holds enough of them of more than one token count:
one line over a window of large decodes and long prompt chunks is shaped by those and missed the
fixed cost and the rows of small steps (a Zen 4 EPYC's n-gram engine, replayed: after batches of
8-64, its first 16 lone batch-1 steps of 1-8 tokens were forecast 31% off at the median, 8% with
both changes; once a count's ratio below is learned, the two forecast alike), which decide
whether drafts pay at small batches. A model that keeps weights packed for small steps
(models/packed.py) runs two matmul regimes whose costs differ in kind (packed: few bytes, but
each extra row costs a dequantizing pass; dense: more bytes, rows nearly free), so a new token's
cost is learned per regime (a: dense, g: packed) and f is a step too big for the packed weights;
a regime not seen in the window is priced as the other. The jump f is fitted only once the
window's dense steps are MIN_JUMP_ROWS of sizes spanning MIN_JUMP_SPREAD: through fewer, or
through a narrow range of sizes, a line's intercept is noise (a draft model's one prefill of
1,568 tokens set it at 0.73 s, so every catch-up of its backlogs on the dense weights was
forecast at that or more); until then the dense rows' own cost carries it. (As a surcharge on a
shared per-token cost, g could not be negative: a draft model whose dense bf16 rows cost 1.05 ms
each against 0.6 packed had its packed steps forecast at the dense rate, 1.7x their time, and
stopped drafting where drafts paid.) Kernels that work in blocks of rows (the CPU int4 matmul
takes four at a time) or CUDA graphs captured at padded batch sizes make small steps' time a
staircase in their token count that no line follows: for steps of up to SMALL_MAX_TOKENS
tokens, the ratio of the measured time to the line's is learned per token count (and apart for
the forwards of multi-step bursts, which share their step's own work), as a moving average, and
scales the line (a ratio, not a difference: learned at one context it still scales the line at
another, and never drives a forecast to nothing; and it follows this machine's drift from minute
to minute, which a window of 512 steps refitted every 64 does not). A larger step with prompt
tokens (not a large decode batch, whose jitter on a GPU would refit every step) whose forecast
missed by more than REFIT_ERROR refits the line at once: such steps come in runs (a long
prompt's chunks, each attending to more of its own prefix), and the scheduler sizes the next
chunk of the run by the forecast. What is left of those steps' error is noise and what no line
captures: their recent over-runs (how much later than forecast they ran) give the scheduler
`headroom`, the margin an ITL target plans with. Until enough steps are seen, the roofline (the
slower of compute and bandwidth at the machine's peaks) predicts, plus the least per-step
overhead seen so far (time the roofline does not explain: launches, Python, sampling), so that
from the first step on it is not wildly optimistic for a small model. No torch: the scheduler
asks it how big a prefill chunk fits a time target.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tandem.core.roofline import BatchSums, MachinePeaks, ModelShape, StepWork, sums_work

# Steps of up to this many tokens get a line of their own, and a ratio to it per token count.
SMALL_MAX_TOKENS = 64
SMALL_MIN_STEPS = 32  # of them in the window before it is fitted (its 7 features want more than 8)
RESIDUAL_WEIGHT = 0.5  # of the newest step in a token count's moving average
RATIO_MIN, RATIO_MAX = 0.25, 4.0  # a small step's ratio to the line (a tiny line's is wild)
REFIT_ERROR = 0.1  # relative forecast error of a larger step that refits the line at once
# headroom: this quantile of the over-runs of the last HEADROOM_STEPS larger steps with prompt
# tokens (none until HEADROOM_MIN_STEPS of them; kept until newer such steps replace them)
HEADROOM_QUANTILE = 0.9
HEADROOM_STEPS = 32
HEADROOM_MIN_STEPS = 4
HEADROOM_MAX = 0.5  # one wild step must not shrink every chunk to nothing
FEATURE_NAMES = (
    "constant", "dense tokens", "attended beyond the KV read", "KV positions", "sampled rows",
    "dense step", "packed tokens",
)  # fmt: skip
DENSE_TOKENS, PACKED_TOKENS = 1, 6  # the per-token features of the two regimes
DENSE_STEP = 5  # the feature of a step too big for the packed weights
# Dense steps before the jump to them (DENSE_STEP) is fitted: as many, their token counts
# spanning this factor (until then their rows' own cost carries it).
MIN_JUMP_ROWS = 3
MIN_JUMP_SPREAD = 2.0


def features(sums: BatchSums, packed_max_tokens: int = 0) -> tuple[float, ...]:
    """`packed_max_tokens`: the largest step that multiplies packed weights (0: none do)."""
    num_new = sums.num_new_tokens
    packed = num_new <= packed_max_tokens
    return (
        1.0, float(0 if packed else num_new), sums.num_attended - sums.num_context,
        sums.num_context, sums.num_sampled, float(packed_max_tokens > 0 and not packed),
        float(num_new if packed else 0),
    )  # fmt: skip


def residual_key(num_new_tokens: int, num_steps: int) -> tuple[int, bool]:
    """A small step's ratio to the line is learned per token count, and apart for the forwards
    of multi-step bursts: they share their step's own work (scheduling, outputs) where a lone
    step pays all of it, so one ratio for both had forecast bursts 20-40% long and the lone
    steps between them as much short. (Until one kind is seen, the other's ratio serves.)"""
    return num_new_tokens, num_steps > 1


class StepCostModel:
    """Predicts a step's seconds from its BatchSums; `observe` each step's measured time."""

    def __init__(
        self,
        shape: ModelShape,
        peaks: MachinePeaks,
        window: int = 512,
        min_steps: int = 8,
        refit_every: int = 16,
    ) -> None:
        self.shape = shape
        self.peaks = peaks
        self.packed_max_tokens = shape.packed_max_tokens if shape.packed_weights else 0
        self.min_steps = min_steps
        self.refit_every = refit_every
        # The window as a ring of rows: appending a step is two stores, and a fit reads the
        # arrays as they are (a window of tuples took ~0.5 ms to turn into one per fit).
        self._rows = np.zeros((window, len(FEATURE_NAMES)))
        self._times = np.zeros(window)
        self._num_observed = 0
        self._since_fit = 0
        # One per feature (a tuple: the step loop's dot product in Python beats numpy's call).
        self.coefficients: tuple[float, ...] | None = None  # None: the roofline predicts
        # The same over the window's steps of up to SMALL_MAX_TOKENS tokens, which it
        # predicts (None: fewer than SMALL_MIN_STEPS such steps, or of one token count only:
        # the line serves).
        self.small_coefficients: tuple[float, ...] | None = None
        self.overhead: float | None = None  # least (measured - roofline) seen, >= 0
        # Small steps by residual_key: measured time / the fitted line's (moving average).
        self.residuals: dict[tuple[int, bool], float] = {}
        # Larger steps with prompt tokens: measured / forecast time - 1 (negative: early).
        self._overruns: deque[float] = deque(maxlen=HEADROOM_STEPS)
        self.headroom = 0.0
        self.max_observed_tokens = 0  # the most new tokens of any step seen

    def predict(self, sums: BatchSums, num_steps: int = 1) -> float:
        """Seconds for a step of these sums, or for a burst of `num_steps` forwards of them."""
        if self.coefficients is None:
            return num_steps * (self.roofline_seconds(sums) + (self.overhead or 0.0))
        line = self._line(features(sums, self.packed_max_tokens), sums.num_new_tokens)
        return num_steps * line * self._ratio(residual_key(sums.num_new_tokens, num_steps))

    def _ratio(self, key: tuple[int, bool]) -> float:
        ratio = self.residuals.get(key)
        return ratio if ratio is not None else self.residuals.get((key[0], not key[1]), 1.0)

    def _line(self, row: tuple[float, ...], num_new_tokens: int) -> float:
        coefficients = self.coefficients
        if num_new_tokens <= SMALL_MAX_TOKENS and self.small_coefficients is not None:
            coefficients = self.small_coefficients
        assert coefficients is not None
        return sum(c * f for c, f in zip(coefficients, row, strict=True))

    def roofline_seconds(self, sums: BatchSums) -> float:
        return self._roofline_seconds(sums_work(self.shape, sums))

    def _roofline_seconds(self, work: StepWork) -> float:
        peaks = self.peaks
        return max(work.flops / peaks.flops_per_second, work.bytes / peaks.bytes_per_second)

    def observe(
        self, sums: BatchSums, seconds: float, work: StepWork | None = None, num_steps: int = 1
    ) -> float:
        """Learn from a step of these sums (a burst of `num_steps` forwards of them) that took
        `seconds`; `work`: their sums_work, where the caller has it. Returns what `predict`
        said of it before (the step loop's one call for both). The model learns a forward's
        time: the step's over its forwards."""
        num_new = sums.num_new_tokens
        self.max_observed_tokens = max(self.max_observed_tokens, num_new)
        row = features(sums, self.packed_max_tokens)
        key = residual_key(num_new, num_steps)
        seconds /= num_steps
        roofline = self._roofline_seconds(sums_work(self.shape, sums) if work is None else work)
        missed_far = False
        if self.coefficients is None:
            predicted = roofline + (self.overhead or 0.0)
        else:
            line = self._line(row, num_new)
            predicted = line * self._ratio(key)
            if num_new <= SMALL_MAX_TOKENS:
                if line > 0:
                    ratio = min(max(seconds / line, RATIO_MIN), RATIO_MAX)
                    previous = self.residuals.get(key)
                    self.residuals[key] = (
                        ratio
                        if previous is None
                        else previous + RESIDUAL_WEIGHT * (ratio - previous)
                    )
            elif num_new > sums.num_sampled and predicted > 0:  # it computed prompt tokens
                missed_far = abs(predicted - seconds) > REFIT_ERROR * seconds
                self._note_overrun(seconds / predicted - 1)
        unexplained = max(0.0, seconds - roofline)
        self.overhead = unexplained if self.overhead is None else min(self.overhead, unexplained)
        slot = self._num_observed % len(self._times)
        self._rows[slot] = row
        self._times[slot] = seconds
        self._num_observed += 1
        self._since_fit += 1
        num_rows = min(self._num_observed, len(self._times))
        # While the window is short every new step teaches a lot: refit more often; a long
        # window, once an eighth of it is new (a fit of both lines takes ~0.12 ms in a warm
        # loop, one line 0.05, and a few times that right after a forward, where one line took
        # ~0.2 ms; small steps and missed prompt steps are followed without it).
        if num_rows < 4 * self.refit_every:
            every = self.min_steps // 2
        else:
            every = max(self.refit_every, num_rows // 8)
        if num_rows >= self.min_steps and (self._since_fit >= max(1, every) or missed_far):
            self._fit()
        return num_steps * predicted

    def _note_overrun(self, overrun: float) -> None:
        self._overruns.append(overrun)
        if len(self._overruns) >= HEADROOM_MIN_STEPS:
            ordered = sorted(self._overruns)
            upper = ordered[min(len(ordered) - 1, int(HEADROOM_QUANTILE * len(ordered)))]
            self.headroom = min(max(0.0, upper), HEADROOM_MAX)

    def _fit(self) -> None:
        """Refit the line over the window, and the small steps' line over its small steps
        where it holds enough of them, of more than one token count. Rows that cannot be
        fitted keep a line's previous coefficients."""
        self._since_fit = 0
        num_rows = min(self._num_observed, len(self._times))
        rows, times = self._rows[:num_rows], self._times[:num_rows]
        coefficients = least_squares(rows, times)
        if coefficients is not None:
            self.coefficients = coefficients
        tokens = rows[:, DENSE_TOKENS] + rows[:, PACKED_TOKENS]
        small = tokens <= SMALL_MAX_TOKENS
        small_tokens = tokens[small]
        # (min < max, not np.unique: its first call imports numpy.ma, ~10 ms in a step.)
        if len(small_tokens) >= SMALL_MIN_STEPS and small_tokens.min() < small_tokens.max():
            small_coefficients = least_squares(rows[small], times[small])
            if small_coefficients is not None:
                self.small_coefficients = small_coefficients
        else:
            self.small_coefficients = None


def spans_a_line(tokens: np.ndarray) -> bool:
    """Whether steps of these token counts (0: not such a step) can place a line's intercept:
    MIN_JUMP_ROWS of them, their counts spanning MIN_JUMP_SPREAD."""
    counts = tokens[tokens > 0]
    return len(counts) >= MIN_JUMP_ROWS and counts.max() >= MIN_JUMP_SPREAD * counts.min()


def least_squares(rows: np.ndarray, times: np.ndarray) -> tuple[float, ...] | None:
    """Least squares; a feature whose coefficient comes out negative (collinear, or not
    varied in the rows) is dropped and the rest refitted, so every prediction grows with the
    work; a regime not seen is priced as the other. None: the rows cannot be fitted."""
    seen = rows.any(axis=0).tolist()
    if seen[DENSE_STEP] and not spans_a_line(rows[:, DENSE_TOKENS]):
        seen[DENSE_STEP] = False  # not fitted: the dense rows' own cost carries the jump
    active = [i for i in range(rows.shape[1]) if seen[i]]
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active], times, rcond=None)
        if (solution >= 0).all():
            coefficients = np.zeros(rows.shape[1])
            coefficients[active] = solution
            for regime, other in ((DENSE_TOKENS, PACKED_TOKENS), (PACKED_TOKENS, DENSE_TOKENS)):
                if not seen[regime]:
                    coefficients[regime] = coefficients[other]
            return tuple(coefficients.tolist())
        active = [i for i, value in zip(active, solution, strict=True) if value >= 0]
    return None
