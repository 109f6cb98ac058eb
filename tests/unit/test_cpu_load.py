"""A timing that other processes competed with is used but never cached: the arithmetic of
what counts as competing, and a real busy neighbour caught in the act."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from tandem import cpu_load
from tandem.cache import cached_measurement
from tandem.cpu_load import CONTENDED_CORES, CpuClock, contended, cpu_clock, other_cores


def clock(wall: float, own: float, busy: float | None) -> CpuClock:
    return CpuClock(wall=wall, own=own, busy=busy)


def test_other_work_is_the_busy_time_this_process_did_not_use():
    start = clock(10.0, 5.0, 100.0)
    # 2 s: this process used 3.6 CPU s, the CPUs were busy 5.6 s: 2 s of other work, 1 core.
    assert other_cores(start, clock(12.0, 8.6, 105.6)) == pytest.approx(1.0)
    # Housekeeping under NEGLIGIBLE_SECONDS counts as none, even over a short interval.
    assert other_cores(start, clock(10.05, 5.09, 100.1)) == 0.0
    # Unknown busy time (off Linux) or no time passed: no answer.
    assert other_cores(clock(10.0, 5.0, None), clock(12.0, 8.0, None)) is None
    assert other_cores(start, clock(10.0, 5.0, 100.0)) is None


def test_spare_cpus_are_counted_by_core(tmp_path):
    """Four logical CPUs on two cores (two hyperthreads each), and one whose topology the
    system does not give (its own core)."""
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(f"{siblings}\n")
    assert cpu_load.physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert cpu_load.physical_cores({0, 2}, tmp_path) == 1
    assert cpu_load.physical_cores({0, 1, 2, 3, 4}, tmp_path) == 3


def test_contention_means_taking_cpus_the_measurement_needed(monkeypatch):
    monkeypatch.setattr(cpu_load, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_load, "physical_cores", len)  # no hyperthreads
    start = clock(0.0, 0.0, 0.0)
    one_core_of_others = clock(1.0, 2.0, 3.0)
    # Two threads on four CPUs leave two spare: a neighbour on one of them is no contention.
    assert contended(start, one_core_of_others, cores=2) is None
    # Four threads need every CPU.
    assert contended(start, one_core_of_others, cores=4) == pytest.approx(1.0)
    below = clock(1.0, 2.0, 2.0 + CONTENDED_CORES / 2)
    assert contended(start, below, cores=4) is None
    assert contended(clock(0.0, 0.0, None), clock(1.0, 2.0, None), cores=4) is None


def test_a_contended_measurement_is_used_but_not_cached(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("tandem.cache._this_process_only", {})
    busy = [2.5]
    monkeypatch.setattr("tandem.cache.contended", lambda *args: busy[0])
    calls = []

    def measure() -> list[int]:
        calls.append(1)
        return [len(calls)]

    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert cached_measurement("probe.json", "key", measure, cores=2) == [1]
    assert "2.5 CPUs busy" in caplog.text and "not cached" in caplog.text
    assert not (tmp_path / "probe.json").exists()
    # Kept for this process: a second engine here does not measure again.
    assert cached_measurement("probe.json", "key", measure, cores=2) == [1]
    # The next start (a new process) finds the machine quiet: measured again, and kept.
    monkeypatch.setattr("tandem.cache._this_process_only", {})
    busy[0] = None
    assert cached_measurement("probe.json", "key", measure, cores=2) == [2]
    assert json.loads((tmp_path / "probe.json").read_text()) == {"key": [2]}
    assert cached_measurement("probe.json", "key", measure, cores=2) == [2]
    assert len(calls) == 2


@pytest.mark.skipif(cpu_clock().busy is None, reason="needs Linux's /proc/stat")
def test_a_busy_neighbour_is_caught(tmp_path, monkeypatch):
    """Busy loops in other processes on every CPU this process may use: a measurement that
    wants those CPUs sees them and is not cached."""
    cpus = len(os.sched_getaffinity(0))
    if cpus > 16:
        pytest.skip("too many CPUs to fill with busy loops")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus)]
    try:
        time.sleep(0.5)  # the interpreters start

        def measure() -> int:
            deadline = time.perf_counter() + 1.0
            spins = 0
            while time.perf_counter() < deadline:
                spins += 1
            return spins

        start = cpu_clock()
        cached_measurement("probe.json", "key", measure, cores=cpus)
        others = contended(start, cpu_clock(), cores=cpus)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert others is not None and others > CONTENDED_CORES
    assert not (tmp_path / "probe.json").exists()
