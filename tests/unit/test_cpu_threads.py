"""The forward's thread count under contention (worker/cpu_threads.py): fewer threads while the
process's threads wait for cores, one more tried now and then, kept once the wait is gone; and
the kernel counter it reads, against a real contended core."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tandem.worker.cpu_threads import (
    CONTENDED,
    CONTENDED_WINDOWS,
    FIRST_PROBE_SECONDS,
    IDLE_GAP_SECONDS,
    MAX_PROBE_SECONDS,
    WINDOW_SECONDS,
    ForwardThreads,
    process_run_delay,
)


class FakeProcess:
    """A run-delay counter and a clock the test advances, and the ForwardThreads reading them,
    past its first step (which starts its first window)."""

    def __init__(self, max_threads: int) -> None:
        self.delay = 0.0
        self.now = 0.0
        self.threads = ForwardThreads(max_threads, lambda: self.delay, lambda: self.now)
        assert self.step(0.0, WINDOW_SECONDS / 2) is None

    def step(self, wait: float, seconds: float) -> int | None:
        """A step of `seconds` right after the last, waiting `wait` s per s of it."""
        self.delay += wait * seconds
        self.now += seconds
        return self.threads.observe(seconds)

    def windows(self, wait: float, count: int) -> list[int]:
        """`count` windows of steps (two steps each); the changes they were answered with."""
        changes = [self.step(wait, WINDOW_SECONDS / 2) for _ in range(2 * count)]
        return [change for change in changes if change is not None]


def test_an_uncontended_forward_keeps_every_thread():
    process = FakeProcess(4)
    assert process.windows(wait=0.1, count=100) == []
    assert process.threads.threads == 4


def test_contention_drops_a_thread_per_contended_stretch_down_to_one():
    process = FakeProcess(3)
    assert process.windows(wait=1.5 * CONTENDED, count=CONTENDED_WINDOWS) == [2]
    assert process.windows(wait=1.5 * CONTENDED, count=CONTENDED_WINDOWS) == [1]
    assert process.windows(wait=2.0, count=3) == []  # never below one
    assert process.threads.threads == 1


def test_one_contended_window_is_a_burst_not_a_neighbour():
    """The API process's work when many requests arrive together fills a window; a busy
    process beside the engine fills every one."""
    process = FakeProcess(2)
    for _ in range(10):
        assert process.windows(wait=1.0, count=CONTENDED_WINDOWS - 1) == []
        assert process.windows(wait=0.0, count=1) == []
    assert process.threads.threads == 2


def test_what_the_threads_waited_while_idle_is_not_counted():
    process = FakeProcess(2)
    assert process.windows(wait=1.0, count=CONTENDED_WINDOWS - 1) == []
    process.delay += 5.0  # idle beside a busy API process, say
    process.now += 10 * IDLE_GAP_SECONDS
    assert process.windows(wait=0.0, count=2 * CONTENDED_WINDOWS) == []
    assert process.threads.threads == 2


def test_short_bursts_between_pauses_still_lead_to_a_try():
    """Bursts of steps too short to fill a window count down to the next try all the same."""
    process = FakeProcess(2)
    assert process.windows(wait=1.0, count=CONTENDED_WINDOWS) == [1]
    changes = []
    for _ in range(round(FIRST_PROBE_SECONDS / 0.1) + 1):
        process.now += 10 * IDLE_GAP_SECONDS  # a pause, then 0.1 s of steps
        changes += [process.step(0.0, 0.05), process.step(0.0, 0.05)]
    assert [change for change in changes if change is not None] == [2]


def test_a_failed_try_waits_twice_as_long_before_the_next():
    process = FakeProcess(2)
    assert process.windows(wait=1.0, count=CONTENDED_WINDOWS) == [1]
    windows_before = round(FIRST_PROBE_SECONDS / WINDOW_SECONDS)
    # One thread, no wait: after FIRST_PROBE_SECONDS of steps it tries two.
    assert process.windows(wait=0.0, count=windows_before - 1) == []
    assert process.windows(wait=0.0, count=1) == [2]
    # One window decides a try: it meets the other process again, back to one, and the next
    # try waits twice as long.
    assert process.windows(wait=1.0, count=1) == [1]
    assert process.windows(wait=0.0, count=2 * windows_before - 1) == []
    assert process.windows(wait=0.0, count=1) == [2]
    # The cores are free now: it keeps two, and tries sooner again after a later drop.
    assert process.windows(wait=0.0, count=20) == []
    assert process.threads.threads == 2
    assert process.windows(wait=1.0, count=CONTENDED_WINDOWS) == [1]
    assert process.windows(wait=0.0, count=windows_before) == [2]


def test_the_wait_between_tries_stops_growing():
    process = FakeProcess(2)
    assert process.windows(wait=1.0, count=CONTENDED_WINDOWS) == [1]
    # Under contention for good, tries come at 2, 4, ..., MAX_PROBE_SECONDS of steps apart,
    # each one window long.
    budget = 4 * MAX_PROBE_SECONDS
    tries = process.windows(wait=1.0, count=round(budget / WINDOW_SECONDS)).count(2)
    expected, every = 0, FIRST_PROBE_SECONDS
    while budget >= every + WINDOW_SECONDS:
        budget -= every + WINDOW_SECONDS
        expected += 1
        every = min(2 * every, MAX_PROBE_SECONDS)
    assert tries == expected and tries >= 5
    assert process.threads.threads == 1


def test_without_the_counter_nothing_changes():
    clock = iter(range(100))
    threads = ForwardThreads(2, lambda: None, lambda: next(clock) * WINDOW_SECONDS)
    assert all(threads.observe(WINDOW_SECONDS) is None for _ in range(50))
    assert threads.threads == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat: Linux")
def test_the_counter_sees_a_core_shared_with_a_busy_process():
    """This thread and a busy process pinned to the same CPU: the thread's run delay grows
    by a good share of the time it spins; alone on its CPU, by little."""
    cpu = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)

    def spin(seconds: float) -> float:
        start_delay, end = process_run_delay(), time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return process_run_delay() - start_delay

    os.sched_setaffinity(0, {cpu})
    try:
        alone = spin(0.3)
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            os.sched_setaffinity(busy.pid, {cpu})
            time.sleep(0.2)
            shared = spin(0.6)
        finally:
            busy.kill()
            busy.wait()
    finally:
        os.sched_setaffinity(0, before_affinity)
    # Half of the 0.6 s, less what the scheduler rounds, more than whatever else ran there.
    assert shared - alone > 0.1, (alone, shared)
