"""The engine beside busy processes (worker/cpu_threads.py): it drops forward threads while
they hold the cores, takes them back once they are gone, and its greedy tokens are the same
on either thread count (up to a near-tie)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tandem import LLM

from greedy_reference import assert_same_greedy, greedy
from server_process import KV_CACHE_MEMORY_BYTES

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300, func_only=True),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat: Linux"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one forward thread: none to drop"),
    # One busy process per CPU this process may run on: a few, not a big machine's worth.
    pytest.mark.skipif(len(os.sched_getaffinity(0)) > 8, reason="more than 8 CPUs"),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a"]


def generate_until(llm: LLM, done, seconds: float) -> list:
    """Generate the prompts again and again until `done()` or `seconds` have passed; the
    last outputs."""
    deadline = time.monotonic() + seconds
    while True:
        outputs = llm.generate(PROMPTS, greedy(24, ignore_eos=True), use_tqdm=False)
        if done() or time.monotonic() > deadline:
            return outputs


def forward_threads(core) -> int:
    """The thread count the forwards run with (OpenMP's count is per thread): on the
    executor's thread, or on the caller's while the offline loop runs."""
    if core._executor is not None:
        return core._executor.submit(torch.get_num_threads).result()
    with core.forward_thread_count():
        return torch.get_num_threads()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_gives_cores_up_and_takes_them_back(async_scheduling):
    original = torch.get_num_threads()
    llm = LLM("default", dtype="float32", kv_cache_memory=KV_CACHE_MEMORY_BYTES,
              async_scheduling=async_scheduling)  # fmt: skip
    core = llm.llm_engine.core
    threads = core.forward_threads
    assert threads is not None and threads.threads == original
    try:
        alone = llm.generate(PROMPTS, greedy(24, ignore_eos=True), use_tqdm=False)
        busy = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in os.sched_getaffinity(0)
        ]
        try:
            shared = generate_until(llm, lambda: threads.threads < original, 120)
            assert threads.threads < original
            assert forward_threads(core) == threads.threads
            assert torch.get_num_threads() == original  # the caller's own, between loops
        finally:
            for process in busy:
                process.kill()
                process.wait()
        generate_until(llm, lambda: threads.threads == original, 120)
        assert threads.threads == original
        assert forward_threads(core) == original
    finally:
        torch.set_num_threads(original)  # for the tests after this one, whatever happened
    for before, during in zip(alone, shared, strict=True):
        reference = before.outputs[0]
        output = during.outputs[0]
        assert_same_greedy(output.token_ids, output.text, reference, before.prompt)


def test_the_count_stays_put_when_asked():
    llm = LLM("default", kv_cache_memory=KV_CACHE_MEMORY_BYTES, adapt_cpu_threads=False)
    assert llm.llm_engine.core.forward_threads is None
