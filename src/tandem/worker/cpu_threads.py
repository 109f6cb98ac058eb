"""The CPU forward's thread count, fitted to the cores other processes leave it.

The forward splits each matmul and attention call over one OpenMP thread per core, and every
call ends at a barrier. When another busy process shares one of those cores, the thread on it
runs only between that process's time slices, and every barrier waits for it: one Python busy
loop beside a 2-thread server took a stream from ~250 to 94 tok/s (the loop in the server's
session) or to 2 (in another), while the same server on one thread streamed ~190 beside it
(BENCHMARKS.md, issue 10). So the engine watches how long its threads wait, runnable, for a
core (Linux's per-thread schedstat), and drops a thread while they wait; now and then it tries
a thread more, and keeps it if the wait does not come back. (cpu_load.py counts the other work
on this process's CPUs instead, for probes that must not keep a contended timing; here that
count would include the API process's own chunks, and says nothing of whether the forward's
threads waited.)
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Seconds of steps each verdict covers: a few burst steps at batch 1, one starved step.
WINDOW_SECONDS = 0.25
# Seconds the process's threads waited for a core per second of steps, from which the cores
# count as taken: the API process's chunks and the engine's other threads take ~0.1 here
# (32 streams), a busy process beside them 0.4-1.
CONTENDED = 0.3
# Windows in a row that must be contended before a thread goes: a burst of the API process's
# own work (requests arriving together) fills one.
CONTENDED_WINDOWS = 2
# A pause between steps longer than this (the engine idle) starts a new window.
IDLE_GAP_SECONDS = 0.05
FIRST_PROBE_SECONDS = 2.0  # of steps on fewer threads before trying one more
MAX_PROBE_SECONDS = 32.0  # the wait between tries doubles up to this while each one fails

TASKS = "/proc/self/task"


def process_run_delay() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU (the second
    field of each thread's /proc schedstat), summed; None where Linux does not report it."""
    total, read = 0, False
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"{TASKS}/{task}/schedstat", "rb") as stats:
                total += int(stats.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that has just ended
    return total / 1e9 if read else None


class ForwardThreads:
    """Decides, step by step, how many threads the forward uses (the caller sets them)."""

    def __init__(
        self,
        max_threads: int,
        run_delay: Callable[[], float | None] = process_run_delay,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._run_delay = run_delay
        self._clock = clock
        self._window_busy = 0.0
        self._window_delay = 0.0
        self._last_step_end: float | None = None  # None: no step yet
        self._contended_windows = 0  # in a row, on the current count
        self._probe_every = FIRST_PROBE_SECONDS
        self._until_probe = FIRST_PROBE_SECONDS
        self._probing = False  # the window running now tries one thread more

    def observe(self, busy_seconds: float) -> int | None:
        """After a step that computed for `busy_seconds`: the thread count for the steps from
        the next one on, where it changes (None: keep the current one)."""
        now = self._clock()
        last_end, self._last_step_end = self._last_step_end, now
        if last_end is None or now - busy_seconds - last_end > IDLE_GAP_SECONDS:
            # After a pause (or at the first step) a window starts here: what the threads
            # waited while the engine idled or loaded (beside the API process's own start,
            # say) is not the steps' wait.
            self._start_window()
            self._contended_windows = 0
            return self._count_down(busy_seconds)
        self._window_busy += busy_seconds
        if self._window_busy < WINDOW_SECONDS:
            return self._count_down(busy_seconds)
        delay = self._run_delay()
        if delay is None:
            return None
        busy, waited = self._window_busy, max(0.0, delay - self._window_delay)
        self._window_busy, self._window_delay = 0.0, delay
        contended = waited >= CONTENDED * busy
        self._contended_windows = self._contended_windows + 1 if contended else 0
        logger.debug("forward threads %d: waited %.3f s in %.3f s of steps", self.threads,
                     waited, busy)  # fmt: skip
        if self._probing:  # one window decides a try
            self._probing = False
            if contended:
                self._probe_every = min(2 * self._probe_every, MAX_PROBE_SECONDS)
                self._until_probe = self._probe_every
                return self._fewer(waited / busy)
            self._probe_every = self._until_probe = FIRST_PROBE_SECONDS
            logger.info("forward threads: %d again, the cores are free", self.threads)
            return None
        if self._contended_windows >= CONTENDED_WINDOWS and self.threads > 1:
            self._until_probe = self._probe_every
            return self._fewer(waited / busy)
        return self._count_down(busy_seconds)

    def _count_down(self, busy_seconds: float) -> int | None:
        """On fewer threads, count the steps' time down to the next try of one more (by
        steps, not windows: short bursts of steps between pauses fill no window)."""
        if self.threads == self.max_threads or self._probing:
            return None
        self._until_probe -= busy_seconds
        if self._until_probe > 0:
            return None
        self._probing = True
        self._contended_windows = 0
        self._start_window()  # the try's window holds only steps on the count tried
        self.threads += 1
        return self.threads

    def _start_window(self) -> None:
        self._window_busy, self._window_delay = 0.0, self._run_delay() or 0.0

    def _fewer(self, waiting: float) -> int:
        self.threads -= 1
        self._contended_windows = 0
        logger.info(
            "forward threads: %d, as its threads waited %.2f s for a core per second of steps "
            "(another process shares the cores; trying %d again in %.0f s of steps)",
            self.threads, waiting, self.threads + 1, self._until_probe,
        )  # fmt: skip
        return self.threads
