"""The engine-core process yields the cores to the API process once loaded: every one of its
threads (the forward's OpenMP threads among them) gets the added niceness. Checked in a child
process, since a niceness raised cannot be lowered again without privileges."""

import multiprocessing
import os
import sys
import threading

import pytest

from tandem.engine.core_process import yield_cores


def _report(increment: int, results: multiprocessing.Queue) -> None:
    started, stop = threading.Event(), threading.Event()
    thread_id: list[int] = []

    def worker() -> None:
        thread_id.append(threading.get_native_id())
        started.set()
        stop.wait()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    yield_cores(increment)
    after = [os.getpriority(os.PRIO_PROCESS, tid) for tid in (0, thread_id[0])]
    stop.set()
    thread.join()
    results.put((before, after))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness per thread: Linux")
def test_every_thread_of_the_core_gets_the_niceness():
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_report, args=(3, results))
    child.start()
    before, after = results.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0
    assert after == [min(19, before + 3)] * 2
