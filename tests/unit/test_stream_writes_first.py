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

import pytest

from tandem.engine import core_process
from tandem.engine.config import WRITES_MIN_OUTPUTS
from tandem.engine.core_process import _CoreLoop
from tandem.engine.messages import AddRequest, CoreOutputs, OutputsWritten, Shutdown
from tandem.sampling_params import SamplingParams


class FakeCore:
    """Steps that each give `outputs_per_step` outputs, `num_steps` of them; when each began.
    It refuses every request added."""

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

    def add_request(self, request: object, kv_transfer_params: object) -> None:
        raise ValueError("refused")

    def take_finished_stats(self) -> list:
        return []

    def scheduler_stats(self) -> None:
        return None


class StandInApi:
    """The core's output socket, and the API process behind it: it answers a message that
    asks for it `answer_after` seconds later (None: never), first sending `before_answer`
    if given; it ends the loop once the core has sent `num_messages`."""

    def __init__(
        self,
        inputs: queue.Queue,
        num_messages: int,
        answer_after: float | None,
        before_answer: object | None = None,
    ) -> None:
        self.inputs = inputs
        self.num_messages = num_messages
        self.answer_after = answer_after
        self.before_answer = before_answer
        self.sent: list[CoreOutputs] = []
        self.answer_times: list[float] = []

    @property
    def acks(self) -> list[int]:
        return [message.written_ack for message in self.sent]

    def send(self, message: CoreOutputs) -> None:
        self.sent.append(message)
        if message.written_ack and self.answer_after is not None:
            threading.Thread(target=self._answer, args=(message.written_ack,)).start()
        if len(self.sent) == self.num_messages:
            threading.Timer(0.05, self.inputs.put, (Shutdown(),)).start()

    def _answer(self, ack: int) -> None:
        time.sleep(self.answer_after)
        if self.before_answer is not None:
            self.inputs.put(self.before_answer)
        self.answer_times.append(time.perf_counter())
        self.inputs.put(OutputsWritten(ack))


def run_loop(core: FakeCore, api: StandInApi) -> StandInApi:
    _CoreLoop(core, api, os.getppid()).run(api.inputs)  # type: ignore[arg-type]
    return api


@pytest.fixture
def max_wait(monkeypatch):
    """Sets the core's longest wait (a loaded CI machine needs room either way)."""

    def set_wait(seconds: float) -> None:
        monkeypatch.setattr(core_process, "WRITES_MAX_WAIT_SECONDS", seconds)

    return set_wait


def test_the_next_step_waits_for_the_writes(max_wait):
    max_wait(1.0)
    core = FakeCore(num_steps=4, outputs_per_step=WRITES_MIN_OUTPUTS, writes_first=True)
    api = run_loop(core, StandInApi(queue.Queue(), 4, answer_after=0.02))
    assert api.acks == [1, 2, 3, 4]
    for answered, next_step in zip(api.answer_times, core.step_times[1:], strict=False):
        assert next_step >= answered


def test_an_api_process_that_does_not_answer_holds_a_step_back_only_so_long(max_wait):
    max_wait(0.05)
    core = FakeCore(num_steps=3, outputs_per_step=WRITES_MIN_OUTPUTS, writes_first=True)
    run_loop(core, StandInApi(queue.Queue(), 3, answer_after=None))
    gaps = [b - a for a, b in zip(core.step_times, core.step_times[1:], strict=False)]
    assert all(0.045 <= gap < 1.0 for gap in gaps), gaps


def test_an_input_handled_while_waiting_is_reported(max_wait):
    """A request refused while the core waited, with no step left to run: its error goes out
    at once, not with whatever input comes next."""
    max_wait(1.0)
    core = FakeCore(num_steps=1, outputs_per_step=WRITES_MIN_OUTPUTS, writes_first=True)
    refused = AddRequest("late", [1, 2], SamplingParams(), None, time.monotonic())
    api = run_loop(core, StandInApi(queue.Queue(), 2, 0.01, before_answer=refused))
    assert api.acks == [1, 0]
    assert [error.request_id for error in api.sent[1].errors] == ["late"]


def test_few_streams_or_writes_first_off_ask_for_nothing():
    few = FakeCore(num_steps=3, outputs_per_step=WRITES_MIN_OUTPUTS - 1, writes_first=True)
    assert run_loop(few, StandInApi(queue.Queue(), 3, answer_after=None)).acks == [0, 0, 0]
    off = FakeCore(num_steps=3, outputs_per_step=32, writes_first=False)
    assert run_loop(off, StandInApi(queue.Queue(), 3, answer_after=None)).acks == [0, 0, 0]
