"""Stream writes first: after a step's outputs for many streams the engine core waits, briefly,
for the API process to have written their chunks before its next forward takes every core.
The core's side, against a fake engine and a stand-in API process (the API process's side:
test_async_llm_stats.py)."""

from __future__ import annotations

import os
import queue
import threading
import time
from types import SimpleNamespace

from tandem.engine.core_process import WRITES_MAX_WAIT_SECONDS, WRITES_MIN_OUTPUTS, _CoreLoop
from tandem.engine.messages import CoreOutputs, OutputsWritten, Shutdown
from tandem.engine.stats import SchedulerStats

STATS = SchedulerStats(0, 0, 0.0, 16, 16, 0, 0, 0, 1, 2)


class FakeCore:
    """Steps that each give `outputs_per_step` outputs, `num_steps` of them; when each began."""

    def __init__(self, num_steps: int, outputs_per_step: int, writes_first: bool) -> None:
        self.config = SimpleNamespace(stream_writes_first=writes_first)
        self.kv_connector = None
        self.num_steps = 0
        self.steps_left = num_steps
        self.outputs_per_step = outputs_per_step
        self.step_times: list[float] = []

    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self) -> list[object]:
        self.step_times.append(time.perf_counter())
        self.steps_left -= 1
        self.num_steps += 1
        return [object()] * self.outputs_per_step

    def take_finished_stats(self) -> list:
        return []

    def scheduler_stats(self) -> SchedulerStats:
        return STATS


class StandInApi:
    """The core's output socket, and the API process behind it: it answers a message that
    asks for it `answer_after` seconds later (None: never), and ends the loop once the core
    has sent `num_messages`."""

    def __init__(self, inputs: queue.Queue, num_messages: int, answer_after: float | None):
        self.inputs = inputs
        self.num_messages = num_messages
        self.answer_after = answer_after
        self.acks: list[int] = []
        self.answer_times: list[float] = []

    def send(self, message: CoreOutputs) -> None:
        self.acks.append(message.written_ack)
        if message.written_ack and self.answer_after is not None:
            threading.Thread(target=self._answer, args=(message.written_ack,)).start()
        if len(self.acks) == self.num_messages:
            threading.Timer(0.05, self.inputs.put, (Shutdown(),)).start()

    def _answer(self, ack: int) -> None:
        time.sleep(self.answer_after)
        self.answer_times.append(time.perf_counter())
        self.inputs.put(OutputsWritten(ack))


def run_loop(core: FakeCore, answer_after: float | None) -> StandInApi:
    inputs: queue.Queue = queue.Queue()
    api = StandInApi(inputs, core.steps_left, answer_after)
    _CoreLoop(core, api, os.getppid()).run(inputs)  # type: ignore[arg-type]
    return api


def test_the_next_step_waits_for_the_writes():
    core = FakeCore(num_steps=4, outputs_per_step=WRITES_MIN_OUTPUTS, writes_first=True)
    api = run_loop(core, answer_after=0.002)
    assert api.acks == [1, 2, 3, 4]
    for answered, next_step in zip(api.answer_times, core.step_times[1:], strict=False):
        assert next_step >= answered


def test_an_api_process_that_does_not_answer_holds_a_step_back_only_so_long():
    core = FakeCore(num_steps=3, outputs_per_step=WRITES_MIN_OUTPUTS, writes_first=True)
    run_loop(core, answer_after=None)
    gaps = [b - a for a, b in zip(core.step_times, core.step_times[1:], strict=False)]
    assert all(WRITES_MAX_WAIT_SECONDS * 0.9 <= gap < 0.5 for gap in gaps), gaps


def test_few_streams_or_writes_first_off_ask_for_nothing():
    few = FakeCore(num_steps=3, outputs_per_step=WRITES_MIN_OUTPUTS - 1, writes_first=True)
    assert run_loop(few, answer_after=None).acks == [0, 0, 0]
    off = FakeCore(num_steps=3, outputs_per_step=32, writes_first=False)
    assert run_loop(off, answer_after=None).acks == [0, 0, 0]
