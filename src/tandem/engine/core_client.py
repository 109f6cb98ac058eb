"""The API process's handle on the engine-core process: starts it (spawn: a forked torch is not
safe), binds the two ZeroMQ sockets it connects to, and sends and receives typed messages."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from tandem.engine.config import EngineConfig
from tandem.engine.core_process import run_engine_core
from tandem.engine.messages import CoreFailed, CoreInput, CoreMessage, CoreReady, Shutdown


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self._socket_dir = tempfile.mkdtemp(prefix="tandem-")
        input_address = f"ipc://{self._socket_dir}/input"
        output_address = f"ipc://{self._socket_dir}/output"
        self._context = zmq.asyncio.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_address, output_address, os.getpid()),
            name="tandem-engine-core",
            daemon=True,
        )
        self.process.start()

    async def wait_ready(self, timeout: float) -> CoreReady:
        """The core's start-up report; raises EngineDeadError if it failed or died loading."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._output.poll(timeout=200):
                message = await self.recv()
                if isinstance(message, CoreReady):
                    return message
                if isinstance(message, CoreFailed):
                    raise EngineDeadError(f"the engine core failed to start: {message.message}")
            elif not self.process.is_alive():
                raise EngineDeadError(
                    f"the engine core exited with code {self.process.exitcode} while starting"
                )
        raise EngineDeadError(f"the engine core was not ready within {timeout:.0f} s")

    def send(self, message: CoreInput) -> None:
        """Queue a message for the core without waiting (ZeroMQ sends in the background)."""
        self._input.send(self._encoder.encode(message), copy=False)

    async def recv(self) -> CoreMessage:
        return self._decoder.decode(await self._output.recv())

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to stop, then make sure it has (it ignores SIGTERM: SIGKILL)."""
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.send(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def watch_death(self, callback) -> None:
        """Call `callback()` in the event loop as soon as the core process ends."""
        loop = asyncio.get_running_loop()

        def on_exit() -> None:
            loop.remove_reader(self.process.sentinel)
            self.process.join(1)  # it has ended: reap it, so that exitcode is known
            callback()

        loop.add_reader(self.process.sentinel, on_exit)
