"""What a step will cost, learned on the machine it runs on: step time as a linear function of
the batch's sums (core/roofline.py), time = c + a * new tokens + b * attended positions
+ d * KV positions read + e * sampled rows, fitted by least squares over a window of recent
steps and refitted as steps come in, so it follows the machine and the load. Until enough
steps are seen, the roofline (the slower of compute and bandwidth at the machine's peaks)
predicts, plus the least per-step overhead seen so far (time the roofline does not explain:
launches, Python, sampling), so that from the first step on it is not wildly optimistic for
a small model. No torch: the scheduler asks it how big a prefill chunk fits a time target.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from tandem.core.roofline import BatchSums, MachinePeaks, ModelShape, sums_work

FEATURE_NAMES = ("constant", "new tokens", "attended positions", "KV positions", "sampled rows")


def features(sums: BatchSums) -> tuple[float, float, float, float, float]:
    return (1.0, sums.num_new_tokens, sums.num_attended, sums.num_context, sums.num_sampled)


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
        self.min_steps = min_steps
        self.refit_every = refit_every
        self._rows: deque[tuple[float, ...]] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.coefficients: np.ndarray | None = None  # None: the roofline predicts
        self.overhead: float | None = None  # least (measured - roofline) seen, >= 0

    def predict(self, sums: BatchSums) -> float:
        if self.coefficients is None:
            return self.roofline_seconds(sums) + (self.overhead or 0.0)
        return float(np.dot(self.coefficients, features(sums)))

    def roofline_seconds(self, sums: BatchSums) -> float:
        work = sums_work(self.shape, sums)
        peaks = self.peaks
        return max(work.flops / peaks.flops_per_second, work.bytes / peaks.bytes_per_second)

    def observe(self, sums: BatchSums, seconds: float) -> None:
        unexplained = max(0.0, seconds - self.roofline_seconds(sums))
        self.overhead = unexplained if self.overhead is None else min(self.overhead, unexplained)
        self._rows.append(features(sums))
        self._times.append(seconds)
        self._since_fit += 1
        # While the window is short every new step teaches a lot: refit more often.
        every = self.refit_every if len(self._rows) >= 4 * self.refit_every else self.min_steps // 2
        if len(self._rows) >= self.min_steps and self._since_fit >= max(1, every):
            self._fit()

    def _fit(self) -> None:
        """Least squares; a feature whose coefficient comes out negative (collinear, or not
        varied in the window) is dropped and the rest refitted, so every prediction grows with
        the work. A window that cannot be fitted keeps the previous coefficients."""
        self._since_fit = 0
        rows, times = np.array(self._rows), np.array(self._times)
        active = [i for i in range(rows.shape[1]) if rows[:, i].any()]
        while active:
            solution, *_ = np.linalg.lstsq(rows[:, active], times, rcond=None)
            if (solution >= 0).all():
                coefficients = np.zeros(rows.shape[1])
                coefficients[active] = solution
                self.coefficients = coefficients
                return
            active = [i for i, value in zip(active, solution, strict=True) if value >= 0]
