"""The engine-core process: a busy loop of schedule → forward → sample → update. Inputs arrive
on a ZeroMQ PULL socket, read and decoded by a thread (so decoding overlaps the forward, which
releases the GIL); each step's outputs leave in one message that the loop writes to the API
process's Unix socket itself. It blocks only when it has nothing to run, when the API process
has fallen a whole socket buffer behind in reading its outputs, or (stream writes first) for
at most WRITES_MAX_WAIT_SECONDS while the API process writes a step's chunks."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
from typing import Any

import msgspec
import torch
import zmq

from tandem.engine.config import WRITES_MAX_WAIT_SECONDS, WRITES_MIN_OUTPUTS, EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.gc_policy import freeze_startup_objects, step_loop_gc
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInput,
    CoreOutputs,
    CoreReady,
    OutputsWritten,
    RequestError,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from tandem.engine.stats import SchedulerStats
from tandem.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long an idle core waits for input before checking that its parent is still alive (and
# that held KV has not expired).
IDLE_POLL_SECONDS = 0.5
# Put in the input queue by KV transfer threads: they have news for the core.
_WAKE = object()
# Bytes of output the kernel may hold for the API process (capped by net.core.wmem_max).
OUTPUT_SEND_BUFFER = 4 << 20


def _reset_prefix_cache(core: EngineCore) -> bool:
    return core.kv_cache_manager.reset_prefix_cache()


def _scheduler_stats(core: EngineCore) -> SchedulerStats:
    return core.scheduler_stats()


UTILITY_METHODS = {
    "reset_prefix_cache": _reset_prefix_cache,
    "scheduler_stats": _scheduler_stats,
}


class _Output:
    """The core's end of the output socket: each message as a 4-byte little-endian length and
    its msgpack, written by the step loop. A blocking write: the API process's event loop reads
    as soon as it runs, and if it fell behind by a whole socket buffer the step loop would wait
    for it rather than queue outputs without bound."""

    def __init__(self, path: str) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, OUTPUT_SEND_BUFFER)
        self.socket.connect(path)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, message: Any) -> None:
        """Raises ConnectionError once the API process has gone."""
        payload = self.encoder.encode(message)
        self.socket.sendall(len(payload).to_bytes(4, "little") + payload)

    def close(self) -> None:
        self.socket.close()


def _read_inputs(context: zmq.Context, address: str, inputs: queue.Queue) -> None:
    """Input thread: receive, decode, queue. A malformed message is a bug in the API process:
    it is logged and dropped, never fatal to the requests already running."""
    pull = context.socket(zmq.PULL)
    pull.connect(address)
    decoder = msgspec.msgpack.Decoder(CoreInput)
    while True:
        frame = pull.recv()
        try:
            inputs.put(decoder.decode(frame))
        except msgspec.DecodeError as error:
            logger.error("dropped an undecodable message from the API process: %s", error)


class _CoreLoop:
    def __init__(self, core: EngineCore, output: _Output, parent_pid: int) -> None:
        self.core = core
        self.output = output
        self.parent_pid = parent_pid
        self.errors: list[RequestError] = []
        self.running = True
        self.writes_first = core.config.stream_writes_first
        self.num_acks = 0  # outputs messages sent whose writes the core waited for
        self.written_ack = 0  # the latest the API process has answered
        self.handled_while_waiting = False  # inputs the next outputs message must report

    def run(self, inputs: queue.Queue) -> None:
        while self.running:
            if not self.core.has_work() and not self.handled_while_waiting:
                try:
                    self._handle(inputs.get(timeout=IDLE_POLL_SECONDS))
                except queue.Empty:
                    self._check_parent()
                    if self.core.kv_connector is None:
                        continue
            changed = self._drain(inputs) or self.handled_while_waiting
            self.handled_while_waiting = False
            if not self.running:
                return
            num_steps = self.core.num_steps
            has_work = self.core.has_work()
            if not has_work and self.core.kv_connector is not None:
                # step() lands transfers itself; idle, land them here (a load may make work)
                self.core.poll_kv_transfers()
                changed = True  # its counters may have moved: report them
                has_work = self.core.has_work()
            outputs = self.core.step() if has_work else []
            stepped = self.core.num_steps != num_steps
            steps = self.core.take_finished_stats()  # an abort while idle may have made some
            if outputs or stepped or changed or self.errors or steps:
                ack = 0
                if self.writes_first and len(outputs) >= WRITES_MIN_OUTPUTS:
                    self.num_acks += 1
                    ack = self.num_acks
                stats = self.core.scheduler_stats()
                self._send(CoreOutputs(outputs, self.errors, stats, steps, ack))
                self.errors = []
                if ack:
                    self._wait_for_writes(inputs, ack)
            self._check_parent()

    def _wait_for_writes(self, inputs: queue.Queue, ack: int) -> None:
        """Stream writes first: on a CPU the next forward's threads take every core, and the
        API process, writing a chunk per stream of the outputs just sent (~1.5 ms of CPU for
        32), lost its core to them for a scheduler tick in about one step of ten (delivery p99
        7.5 ms; 3-4 ms waiting: BENCHMARKS.md, issue 7). Other inputs are handled meanwhile,
        and reported with the next outputs message."""
        deadline = time.perf_counter() + WRITES_MAX_WAIT_SECONDS
        while self.written_ack < ack and self.running:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            try:
                message = inputs.get(timeout=left)
            except queue.Empty:
                return
            self._handle(message)
            if not isinstance(message, OutputsWritten):
                self.handled_while_waiting = True

    def _drain(self, inputs: queue.Queue) -> bool:
        changed = False
        while self.running:
            try:
                message = inputs.get_nowait()
            except queue.Empty:
                break
            self._handle(message)
            changed = True
        return changed

    def _handle(self, message: Any) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            try:
                core.add_request(
                    Request(
                        message.request_id,
                        message.prompt_token_ids,
                        message.sampling_params,
                        message.eos_token_id,
                        message.arrival_time,
                        message.cache_salt,
                        message.priority,
                    ),
                    message.kv_transfer_params,
                )
            except ValueError as error:
                self.errors.append(RequestError(message.request_id, str(error)))
        elif isinstance(message, AbortRequests):
            core.finish_requests(message.request_ids, RequestStatus.FINISHED_ABORTED)
        elif isinstance(message, UtilityCall):
            self._call_utility(message)
        elif isinstance(message, OutputsWritten):
            self.written_ack = max(self.written_ack, message.ack)
        elif isinstance(message, Shutdown):
            self.running = False

    def _call_utility(self, call: UtilityCall) -> None:
        method = UTILITY_METHODS.get(call.method)
        if method is None:
            result = UtilityResult(call.call_id, error=f"no utility method {call.method!r}")
        else:
            result = UtilityResult(call.call_id, method(self.core, *call.args))
        self._send(result)

    def _send(self, message: Any) -> None:
        try:
            self.output.send(message)
        except ConnectionError:
            logger.info("the API process has closed its end of the outputs: engine core exits")
            self.running = False

    def _check_parent(self) -> None:
        """An orphaned core would spin forever holding the model's memory: exit instead."""
        if os.getppid() != self.parent_pid:
            logger.error("the API process (pid %d) is gone: engine core exits", self.parent_pid)
            self.running = False


def run_engine_core(
    config: EngineConfig, input_address: str, output_path: str, parent_pid: int
) -> None:
    """Entry point of the engine-core process (started with multiprocessing's spawn)."""
    # Ctrl-C and a SIGTERM to the process group (systemd, docker stop, kill -- -pgid) reach
    # the core too; the API process decides when it stops, after draining the requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s core: %(message)s")
    context = zmq.Context()
    output = _Output(output_path)
    exit_code = 0
    core = None
    try:
        start = time.perf_counter()
        core = EngineCore(config)
        output.send(
            CoreReady(
                num_kv_blocks=core.kv_cache_manager.num_blocks,
                block_size=config.runner.block_size,
                max_model_len=core.scheduler.max_model_len,
                load_seconds=time.perf_counter() - start,
            )
        )
        inputs: queue.Queue = queue.Queue()
        if core.kv_connector is not None:
            core.kv_connector.set_wake(lambda: inputs.put(_WAKE))
        reader = threading.Thread(
            target=_read_inputs, args=(context, input_address, inputs), daemon=True
        )
        reader.start()
        freeze_startup_objects()
        # Inference mode for the whole loop: the per-step functions need not enter it each step
        # (worker/inference_mode.py).
        with step_loop_gc(), torch.inference_mode():
            _CoreLoop(core, output, parent_pid).run(inputs)
    except Exception as error:
        logger.error("engine core failed:\n%s", traceback.format_exc())
        with contextlib.suppress(ConnectionError):
            output.send(CoreFailed(f"{type(error).__name__}: {error}"))
        exit_code = 1
    finally:
        if core is not None:
            with contextlib.suppress(Exception):
                core.finish_stats()  # the step log's last lines: the steps before a failure
        output.close()
    os._exit(exit_code)  # the reader thread blocks in recv(); do not wait for it
