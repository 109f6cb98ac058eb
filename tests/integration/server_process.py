"""A real `tandem serve` process for the server's integration tests, and what the tests read back
from it: started on a free loopback port, ready once /health answers 200, its log kept in a file
(attached to the report of a test that fails), stopped with SIGTERM and then SIGKILL."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.launch import free_port, wait_healthy

# Every test server gets a small CPU KV cache: a 2 GiB default per server (and per offline
# reference LLM) only costs memory here, and 512 MiB holds ~11k tokens, plenty for these tests.
KV_CACHE_MEMORY = "512MiB"
KV_CACHE_MEMORY_BYTES = 512 << 20
# Loading the model takes ~10 s on an idle 2-core machine; several times that under contention.
READY_TIMEOUT = 180.0


_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not load it after fork
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the test process dies, even by
    SIGKILL (a timeout), so no server outlives its test run (the engine core follows it)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): read its state
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def child_pids(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return sorted(set(children))


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


class ServerProcess:
    """`tandem serve` with `args` on a free port. Use as a context manager, or start()/stop().
    `command`: another tandem subcommand that serves HTTP with --port and /health (`router`);
    only `serve` gets the small KV cache and fp32 defaults."""

    def __init__(
        self,
        *args: str,
        log_dir: Path,
        name: str = "server",
        env: dict[str, str] | None = None,
        ready_timeout: float = READY_TIMEOUT,
        command: str = "serve",
    ) -> None:
        self.command = command
        if command == "serve":
            # fp32 unless a test asks otherwise: the offline LLM it is compared with runs fp32.
            dtype = [] if "--dtype" in args else ["--dtype", "float32"]
            self.args = ["--kv-cache-memory", KV_CACHE_MEMORY, *dtype, *args]
        else:
            self.args = list(args)
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.ready_seconds: float | None = None

    # -- addresses ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """For openai.OpenAI(base_url=...)."""
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    # -- life ---------------------------------------------------------------------------------

    def start(self) -> ServerProcess:
        for _ in range(3):  # a port taken between free_port() and the bind: try another
            self.launch()
            if self._wait_ready():
                return self
            if "address already in use" not in self.log().lower():
                break
        log = self.log()
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready; its log:\n{log}")

    def launch(self) -> None:
        """Start the process without waiting for it to be ready. Call it from the thread that
        will outlive the server: the child's parent-death signal follows the launching thread."""
        self.port = free_port()
        command = [sys.executable, "-m", "tandem.cli", self.command, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(command + self.args)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command + self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, process_group=0,
            )  # fmt: skip

    @staticmethod
    def start_together(servers: Iterable[ServerProcess]) -> None:
        """Start several servers side by side (their model loads overlap), then wait for each;
        one that did not come up is started again on its own (and raises if it cannot)."""
        servers = list(servers)
        for server in servers:
            server.launch()
        for server in servers:
            if not server._wait_ready():
                server.stop()
                server.start()

    def _wait_ready(self) -> bool:
        self.ready_seconds = wait_healthy(self.url, self.process, self.ready_timeout)
        return self.ready_seconds is not None

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if it is still running after `timeout` seconds."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL (its children too) if it does not exit in time."""
        if self.process is None:
            return None
        children = child_pids(self.pid) if self.process.poll() is None else []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            if self.wait(timeout) is None:
                self.process.kill()
                self.process.wait(10)
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what it shows ------------------------------------------------------------------------

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            time.sleep(0.1)
        raise AssertionError(f"{text!r} not in the {self.name} log within {timeout} s")

    def engine_core_pid(self) -> int:
        """The engine-core child (multiprocessing's spawn child; the other child, if any, is
        multiprocessing's resource tracker)."""
        cores = [p for p in child_pids(self.pid) if "spawn_main" in cmdline(p)]
        assert len(cores) == 1, f"expected one engine-core child, found {cores}"
        return cores[0]

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.url)


# -- /metrics -------------------------------------------------------------------------------


def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (labels summed away, `finished_reason` kept as a
    suffix: `tandem:request_success_total[abort]`)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> dict[str, float]:
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if "finished_reason" in sample.labels:
                name += f"[{sample.labels['finished_reason']}]"
            samples[name] = samples.get(name, 0.0) + sample.value
    return samples


IDLE_GAUGES = ("tandem:num_requests_running", "tandem:num_requests_waiting",
               "tandem:kv_cache_usage_perc")  # fmt: skip


def wait_until_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held; the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape_metrics(url)
        if all(samples[name] == 0 for name in IDLE_GAUGES):
            return samples
        if time.monotonic() > deadline:
            state = {name: samples[name] for name in IDLE_GAUGES}
            raise AssertionError(f"the engine is not idle {timeout} s later: {state}")
        time.sleep(0.2)


# -- a thundering herd ------------------------------------------------------------------------


async def simultaneous_posts(
    port: int, path: str, body: dict, headers: dict[str, str], count: int
) -> list[httpx.Response]:
    """`count` POSTs whose handlers run side by side: each request is sent but for the last
    byte of its body, and once every handler waits for it, the last bytes go out together
    (so checks made before the work starts all see the same state)."""
    raw = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             f"Content-Length: {len(raw)}", "Connection: close",
             *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + raw
    connections = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
    for _, writer in connections:
        writer.write(request[:-1])
        await writer.drain()
    await asyncio.sleep(0.5)
    for _, writer in connections:
        writer.write(request[-1:])
    responses = []
    for reader, writer in connections:
        head, _, content = (await reader.read()).partition(b"\r\n\r\n")
        writer.close()
        status_line, *header_lines = head.decode().split("\r\n")
        fields = [line.split(":", 1) for line in header_lines]
        responses.append(
            httpx.Response(
                int(status_line.split()[1]),
                headers=[(name.strip(), value.strip()) for name, value in fields],
                content=content,
            )
        )
    return responses


# -- responses ------------------------------------------------------------------------------


def sse_events(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of a server-sent-event stream: parsed JSON, or the text "[DONE]"."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            assert line.strip() == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_openai_error(response: httpx.Response, status: int, param: Any = ...) -> dict:
    """The response has `status` and OpenAI's error body; returns its `error` object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = assert_error_shape(response.json())
    if param is not ...:
        assert error["param"] == param, error
    return error


def assert_error_shape(body: Any) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    return error


def joined_reply(stream) -> dict:
    """A streamed chat reply (the `openai` client's chunks) as a client that joins its deltas
    has it: content (None if none), calls by index, finish reason; whole_reply's shape."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "calls": [calls[i] for i in sorted(calls)],
            "finish": finish}  # fmt: skip


def whole_reply(reply) -> dict:
    """A chat reply's content, calls and finish reason, as joined_reply gives a stream's."""
    message = reply.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or ()]  # fmt: skip
    return {"content": message.content, "calls": calls, "finish": reply.choices[0].finish_reason}
