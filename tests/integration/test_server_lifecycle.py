"""How a server process ends: SIGTERM drains what is in flight and exits 0; the engine core's
death ends every request with an error and the server with a non-zero code, never a hang. Each
test starts its own server, since each ends it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_process import _alive, assert_error_shape, assert_openai_error, child_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

MODEL = "default"
API_KEY = "env-key-5d1c"
SHUTDOWN_TIMEOUT = 60  # generous: the streams need ~1 s on an idle machine, a minute when busy
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Water boils at"]


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> dict:
    """Read a completion stream to its end; `started` is set at its first event. Returns the
    events, and the transport error that ended it, if one did."""
    events: list = []
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    payload = line.removeprefix("data: ")
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    started.set()
    except httpx.TransportError as error:
        return {"events": events, "error": error}
    finally:
        started.set()
    return {"events": events, "error": None}


async def _start_streams(client: httpx.AsyncClient, bodies: list[dict]) -> list[asyncio.Task]:
    """Start one stream per body; return once every one has received its first event."""
    events = [asyncio.Event() for _ in bodies]
    tasks = [asyncio.create_task(_stream(client, body, event))
             for body, event in zip(bodies, events, strict=True)]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), 120)
    return tasks


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def test_sigterm_drains_in_flight_streams(server_factory):
    """SIGTERM with streams in flight, to the whole process group (as systemd sends it, so the
    engine core gets it too): each stream runs to its end ([DONE], finish_reason), nothing new
    is admitted, and the process exits 0 within --shutdown-timeout. Also: the API key may come
    from TANDEM_API_KEY, and the log has a ready line and one line per finished request."""
    server = server_factory.start(
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
        name="drain-server", env={"TANDEM_API_KEY": API_KEY},
    )  # fmt: skip
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert_openai_error(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30), 401)
    children = child_pids(server.pid)
    max_tokens = 24
    bodies = [{"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
               "temperature": 0, "return_token_ids": True} for prompt in PROMPTS]  # fmt: skip

    async def run() -> tuple[list[dict], float, object]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as client:
            tasks = await _start_streams(client, bodies)
            os.killpg(server.pid, signal.SIGTERM)  # the server leads its own process group
            signalled = time.monotonic()
            await asyncio.sleep(0.5)
            try:  # a new request while draining: refused, never run
                late = (await client.post("/v1/completions", json=body)).status_code
            except httpx.TransportError as error:
                late = error
            return await asyncio.gather(*tasks), signalled, late

    results, signalled, late = asyncio.run(run())
    assert late == 503 or isinstance(late, httpx.TransportError), late
    exit_code = server.wait(SHUTDOWN_TIMEOUT + 10)
    took = time.monotonic() - signalled
    assert exit_code == 0, f"exit code {exit_code}"
    assert took < SHUTDOWN_TIMEOUT, took
    for result in results:
        assert result["error"] is None, result["error"]
        events = result["events"]
        assert events[-1] == "[DONE]", events[-2:]
        choices = [event["choices"][0] for event in events[:-1]]
        assert [c["finish_reason"] for c in choices if c.get("finish_reason")] == ["length"]
        assert sum(len(c["token_ids"]) for c in choices) == max_tokens
    assert not _wait_gone(children, 10), "the engine core outlived the server"

    log = server.log()
    assert re.search(r"ready in [\d.]+ s", log), log
    finished = re.findall(r"request \S+: (\d+) prompt tokens .*, (\d+) generated, TTFT \d+ ms, "
                          r"E2E \d+ ms, finish_reason=(\w+)", log)  # fmt: skip
    assert len(finished) == len(PROMPTS), finished  # the 401 and the refused one never ran
    assert all(int(n) == max_tokens and reason == "length" for _, n, reason in finished), finished
    assert "stopped (exit code 0)" in log


def test_engine_core_killed_mid_stream(server_factory):
    """SIGKILL to the engine core: streams end with an error event (or a closed connection),
    a waiting non-streamed request gets a 503, /health stops answering 200, and the server
    exits non-zero within seconds."""
    server = server_factory.start(name="doomed-server")
    core = server.engine_core_pid()
    children = child_pids(server.pid)
    long = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[dict], object, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            tasks = await _start_streams(client, [{**long, "prompt": p} for p in PROMPTS[:3]])
            plain = asyncio.create_task(
                client.post("/v1/completions", json={**long, "prompt": PROMPTS[3]})
            )
            await asyncio.sleep(0.5)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            try:
                response = await asyncio.wait_for(plain, 30)
            except httpx.TransportError as error:
                response = error
            return results, response, killed

    results, response, killed = asyncio.run(run())
    for result in results:
        events = result["events"]
        finishes = [e["choices"][0].get("finish_reason") for e in events
                    if isinstance(e, dict) and e.get("choices")]  # fmt: skip
        assert "length" not in finishes, "a stream ran to the end of a dead engine"
        if result["error"] is None:  # the server ended the stream: with an error event
            assert events[-1] == "[DONE]", events[-2:]
            error = assert_error_shape(events[-2])
            assert error["type"] == "service_unavailable", error
    if isinstance(response, httpx.Response):
        assert_openai_error(response, 503)
    else:
        assert isinstance(response, httpx.TransportError), response

    # /health stops saying 200 (503, or nobody listens), and the process exits non-zero.
    while True:
        try:
            status = httpx.get(f"{server.url}/health", timeout=5).status_code
        except httpx.TransportError:
            break
        assert status in (200, 503), status
        if status == 503:
            break
        assert time.monotonic() - killed < 10, "/health still 200 10 s after the core died"
        time.sleep(0.1)
    exit_code = server.wait(max(0.0, killed + 10 - time.monotonic()))
    assert exit_code is not None, "the server still runs 10 s after its engine core died"
    assert exit_code != 0
    assert not _wait_gone(children, 10), "a child of the server outlived it"
    # the log says how the core ended (SIGKILL: -9), not just that it did
    assert "engine core process exited with code -9" in server.log()


def test_a_process_leaving_without_shutdown_takes_its_engine_core_along(tiny_llama):
    """`tandem serve` starts the core before it imports the server; an error in between (or
    anywhere before the engine is shut down) must not leave the core running, nor hang the
    exit (the core ignores the SIGTERM multiprocessing stops daemon children with)."""
    script = (
        "import asyncio\n"
        "from tandem.engine.config import EngineConfig\n"
        "from tandem.engine.core_client import EngineCoreClient\n"
        f"client = EngineCoreClient(EngineConfig.create({str(tiny_llama[0])!r}, "
        "skip_tokenizer_init=True))\n"
        "print(client.process.pid, flush=True)\n"
        "asyncio.run(client.wait_ready(120))  # the core now ignores SIGTERM\n"
        "raise RuntimeError('start-up failed')\n"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 1 and "start-up failed" in result.stderr, result.stderr
    assert time.monotonic() - started < 60
    core = int(result.stdout.split()[0])
    assert not _wait_gone([core], 5), "the engine core outlived its parent"
