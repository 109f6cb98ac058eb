"""The load generator against a fake OpenAI-compatible server (raw HTTP over a local socket, so
it can break a stream the way real servers and networks do): streams that error, drop or end
early are failures, never fast requests; good streams give the timestamps they were sent with."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

import pytest

from tandem.bench.client import ClientConfig, run_workload
from tandem.bench.report import compute_metrics
from tandem.bench.workloads import Session, Turn, Workload

GAP = 0.05  # seconds between the fake server's chunks

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeServer:
    """Answers POST /v1/completions and /v1/chat/completions according to the prompt's first
    word: ok, drop (connection cut mid-stream), nodone (clean close without [DONE]), error (an
    error event), http500, empty (no output, then [DONE])."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> FakeServer:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))  # fmt: skip
                body = json.loads(await reader.readexactly(length))
                self.bodies.append(body)
                if path not in ("/v1/completions", "/v1/chat/completions"):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                if not await self.respond(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def respond(self, body: dict, writer: asyncio.StreamWriter) -> bool:
        """Write one response; False when the connection must close."""
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        mode = prompt.rpartition("User: ")[2].split()[0]  # the newest turn's first word
        if mode == "http500":
            text = b'{"error": {"message": "boom"}}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json"
                         b"\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))  # fmt: skip
            await writer.drain()
            return True
        chunked = mode != "nodone"
        headers = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        headers += (
            b"transfer-encoding: chunked\r\n\r\n" if chunked else b"connection: close\r\n\r\n"
        )
        writer.write(headers)

        async def event(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload) if chunked else payload)
            await writer.drain()

        tokens = body["max_tokens"]
        if chat:
            await event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                 "content": ""}}]}))  # fmt: skip
            await asyncio.sleep(GAP)
        if mode != "empty":
            for i in range(tokens):
                if mode in ("drop", "nodone", "error") and i == 2:
                    break
                last = i == tokens - 1
                choice = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    choice["delta"] = {"content": f" w{i}"}
                else:
                    choice["text"] = f" w{i}"
                await event(json.dumps({"choices": [choice]}))
                await asyncio.sleep(GAP)
        if mode == "drop":
            writer.write(b"5\r\ndat")  # a chunk cut short, then the connection goes
            await writer.drain()
            return False
        if mode == "nodone":
            return False
        if mode == "error":
            await event(json.dumps({"error": {"message": "engine died", "code": 503}}))
        else:
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens,
                     "total_tokens": 0}  # fmt: skip
            await event(json.dumps({"choices": [], "usage": usage}))
        await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def workload(*modes: str, tokens: int = 5) -> Workload:
    return Workload("fake", [Session([Turn(f"{m} a b c", tokens, 4)]) for m in modes])


def run(server: FakeServer, load: Workload, endpoint: str = "completions", **kwargs):
    config = ClientConfig(server.url, "fake", endpoint=endpoint)
    return run_workload(load, config, progress=False, **kwargs)


async def test_good_streams_give_their_timestamps():
    async with FakeServer() as server:
        records, warm = await run(server, workload("ok", "ok", tokens=6))
    assert warm is not None and warm.ok and server.bodies[0]["max_tokens"] == 16
    for record in records:
        assert record.ok, record.error
        assert len(record.chunks) == 6 and record.output_tokens == 6 and record.prompt_tokens == 4
        gaps = [b - a for a, b in zip(record.chunks, record.chunks[1:], strict=False)]
        # Each chunk stamped as it came, not all at the end; a client that read one chunk late
        # (a busy 2-core machine) sees the next one sooner, so the floor is loose.
        assert all(GAP * 0.4 < gap < GAP * 4 for gap in gaps), gaps
        assert record.send <= record.chunks[0] <= record.end
    metrics = compute_metrics(records)
    assert metrics["completed"] == 2 and metrics["failed"] == 0
    assert metrics["itl_ms"]["median"] == pytest.approx(GAP * 1e3, rel=0.6)
    assert all(body["ignore_eos"] and body["stream"] for body in server.bodies)


async def test_chat_role_chunk_is_not_the_first_token():
    async with FakeServer() as server:
        records, _ = await run(server, workload("ok", tokens=4), endpoint="chat")
    (record,) = records
    assert record.ok and len(record.chunks) == 4
    # the role chunk came GAP before the first token: TTFT counts from the token
    assert record.chunks[0] - record.send >= GAP * 0.8


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("drop", "RemoteProtocolError"),
        ("nodone", "ended before data: [DONE]"),
        ("error", "engine died"),
        ("http500", "HTTP 500"),
        ("empty", "no output"),
    ],
)
async def test_broken_streams_are_failures(mode, message):
    async with FakeServer() as server:
        records, _ = await run(server, workload("ok", mode, "ok", tokens=6))
    good, bad, after = records
    assert not bad.ok and message in bad.error, bad.error
    assert good.ok and after.ok  # the others go on
    metrics = compute_metrics(records)
    assert (metrics["completed"], metrics["failed"]) == (2, 1)
    # a failure's early end never shows up as a fast request
    assert metrics["e2el_ms"]["max"] >= 5 * GAP * 1e3 * 0.8


async def test_failed_warmup_stops_the_run():
    from tandem.bench.client import BenchError

    async with FakeServer() as server:
        config = ClientConfig(server.url, "fake")
        load = Workload("fake", [Session([Turn("http500 x", 3, 2)])])
        # the warm-up uses its own prompt; make the server fail it by its first word
        with pytest.raises(BenchError, match="warm-up"):
            await run_workload(load, ClientConfig(server.url + "/nowhere", "fake"), progress=False)
        records, _ = await run_workload(load, config, progress=False, warmup=False)
        assert not records[0].ok


async def test_multi_turn_waits_and_resends_answers():
    async with FakeServer() as server:
        session = Session([Turn("ok one", 3, 2), Turn("ok two", 3, 2), Turn("ok three", 3, 2)])
        records, _ = await run(server, Workload("fake", [session]), warmup=False)
    assert all(r.ok for r in records)
    assert [r.turn for r in records] == [0, 1, 2]
    for earlier, later in itertools.pairwise(records):
        assert later.send >= earlier.end  # a turn waits for the previous answer
    assert "Assistant:  w0 w1 w2\nUser: ok two" in server.bodies[1]["prompt"]
    assert server.bodies[2]["prompt"].count("Assistant:") == 3


async def test_a_failed_turn_ends_its_conversation():
    async with FakeServer() as server:
        session = Session([Turn("ok one", 3, 2), Turn("drop two", 3, 2), Turn("ok three", 3, 2)])
        records, _ = await run(server, Workload("fake", [session]), warmup=False)
    assert [r.ok for r in records] == [True, False, False]
    assert "not sent" in records[2].error and len(server.bodies) == 2


async def test_rate_and_concurrency():
    async with FakeServer() as server:
        load = workload(*["ok"] * 6, tokens=2)
        records, _ = await run(server, load, warmup=False, request_rate=20.0, seed=1)
        sends = sorted(r.scheduled for r in records)
        assert sends[0] == 0.0 and sends[-1] == pytest.approx(5 / 20.0, abs=0.05)
        records, _ = await run(server, load, warmup=False, max_concurrency=2)
    # at most 2 in flight: at any send, fewer than 2 others are between send and end
    for record in records:
        overlapping = [o for o in records if o is not record and o.send <= record.send < o.end]
        assert len(overlapping) <= 1
    assert all(not math.isnan(r.send) for r in records)
