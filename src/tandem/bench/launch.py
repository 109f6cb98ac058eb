"""Start and stop a server for a benchmark: any command that serves HTTP on a port (tandem, a
peer), ready once GET /health answers 200, its output kept in a log file, stopped with SIGTERM
to its process group (then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tandem_serve_command(args: Sequence[str] = (), port: int | str = "{port}") -> list[str]:
    """`tandem serve` by this interpreter; "{port}" is filled in by LaunchedServer."""
    return [
        sys.executable,
        "-m",
        "tandem.cli",
        "serve",
        "--port",
        str(port),
        "--disable-log-requests",
        *args,
    ]


def wait_healthy(
    url: str, process: subprocess.Popen, timeout: float, interval: float = 0.2
) -> float | None:
    """Seconds until `url`/health answered 200; None if the process exited or `timeout`
    seconds passed first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            return None
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        time.sleep(interval)
    return None


class LaunchedServer:
    """`command` (a list; "{port}" in it is replaced by a free port) run in its own session and
    process group, or with `new_session=False` in the caller's (where a benchmark measures what
    shares the server's session). Use as a context manager."""

    def __init__(
        self,
        command: Sequence[str],
        log_path: str | Path,
        ready_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        port: int | None = None,
        new_session: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.command = [part.replace("{port}", str(self.port)) for part in command]
        self.log_path = Path(log_path)
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.new_session = new_session
        self.process: subprocess.Popen | None = None
        self.ready_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LaunchedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=self.new_session,
            )
        self.ready_seconds = wait_healthy(self.url, self.process, self.ready_timeout)
        if self.ready_seconds is not None:
            return self
        self.stop()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{self.command[0]} did not become ready; the end of its log:\n{tail}")

    def stop(self, timeout: float = 60.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        # Its own group, or (in the caller's group) the server alone, which stops its children.
        group = os.getpgid(process.pid) if self.new_session else None

        def send(sig: int) -> None:
            if group is None:
                process.send_signal(sig)
            else:
                os.killpg(group, sig)

        send(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            process.wait(10)
        else:  # the leader is gone; its children (an engine core, workers) go with the group
            if group is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)

    def __enter__(self) -> LaunchedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
