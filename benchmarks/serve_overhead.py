"""What serving over HTTP costs (issue 7): the same requests through the two-process server and
through the offline LLM, in one run, alternating.

- Output tok/s of N concurrent streaming /v1/completions requests (greedy, ignore_eos, M new
  tokens each) against the same prompts through `LLM.generate` (goal: within 10%).
- Sampling to SSE write: every streamed token's time from its sampling in the engine core to its
  chunk being written by the API process (`tandem:token_delivery_seconds`; goal: p99 < 5 ms).
- The API process's CPU seconds per output token, since on a 2-core machine it shares the cores
  with the step loop; and the load generator's, which shares them too (a real client would
  not), so that the throughput ratio can be read for what it is.

    .venv/bin/python benchmarks/serve_overhead.py [--num-requests 32] [--max-tokens 128]
        [--serve-args="--no-stream-writes-first"]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shlex
import socket
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem import LLM, SamplingParams
from tandem.bench.launch import LaunchedServer, tandem_serve_command

HOST = "127.0.0.1"  # the server binds loopback; the load generator runs beside it
TOPICS = [
    "the history of tea", "how bridges carry load", "why the sea is salty", "jazz harmony",
    "the water cycle", "how vaccines work", "the rules of chess", "volcanoes", "bread baking",
    "black holes", "bees and pollination", "the printing press", "compound interest",
    "glaciers", "how a CPU executes code", "the Silk Road", "photosynthesis", "sailing upwind",
    "the immune system", "origami", "plate tectonics", "coffee roasting", "the Roman roads",
    "rainbows", "electric motors", "the Moon's phases", "sourdough", "wind turbines",
    "coral reefs", "the telegraph", "sleep", "mapmaking",
]  # fmt: skip


def prompts(count: int) -> list[str]:
    return [f"Write a short essay about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


def metric_samples(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "le" in sample.labels:
                key += f"{{le={sample.labels['le']}}}"
            samples[key] = sample.value
    return samples


def histogram_quantile(before: dict, after: dict, name: str, quantile: float) -> float:
    """Upper bound of the bucket holding the quantile, over the observations between two
    scrapes (so, conservatively rounded up to a bucket edge)."""
    prefix = f"{name}_bucket{{le="
    buckets = sorted(
        (float(key[len(prefix) : -1]), after[key] - before.get(key, 0.0))
        for key in after
        if key.startswith(prefix)
    )
    total = buckets[-1][1]
    for upper, count in buckets:
        if count >= quantile * total:
            return upper
    return float("inf")


READ_BATCH = 4096  # bytes a stream's reader waits for (~10 chunks), or the end


class _StreamReader(asyncio.Protocol):
    """One streamed response read straight off its socket: the load generator shares the two
    cores with the server (a remote client would not), so it keeps only the response's head and
    its last bytes (the usage event), parses nothing per chunk and wakes once per READ_BATCH
    bytes; httpx's per-chunk work cost more CPU than the API process's own. The server writes
    every chunk as it would to any client: what is timed (sampling to the write) is its own."""

    def __init__(self, request: bytes) -> None:
        self.request = request
        self.head = b""
        self.tail = b""
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Woken once per READ_BATCH bytes, not per chunk: each wake-up on these two cores took
        # time from the API process's burst of writes (a remote client costs it none).
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, READ_BATCH)
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.head:
            self.head = data[:64]
        self.tail = (self.tail + data)[-4096:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed.set_result(exc)


async def one_stream(host: str, port: int, prompt: str, max_tokens: int) -> int:
    """Stream one completion over a connection of its own (`Connection: close`: the server
    closes it after the last chunk); the number of tokens its usage event reports."""
    body = json.dumps({
        "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    _, reader = await loop.create_connection(lambda: _StreamReader(request), host, port)
    if (error := await reader.closed) is not None:
        raise error
    if not reader.head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {reader.head!r}")
    if not reader.tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        raise RuntimeError(f"the stream ended early: {reader.tail[-200:]!r}")
    counts = re.findall(rb'"completion_tokens":(\d+)', reader.tail)
    return int(counts[-1])


async def server_round(
    host: str, port: int, texts: list[str], max_tokens: int
) -> tuple[float, int]:
    start = time.perf_counter()
    counts = await asyncio.gather(*(one_stream(host, port, p, max_tokens) for p in texts))
    return time.perf_counter() - start, sum(counts)


def offline_round(llm: LLM, texts: list[str], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def api_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve-args", default="",
                        help="more `tandem serve` flags, e.g. --serve-args=--no-stream-writes-first"
                        )  # fmt: skip
    args = parser.parse_args()
    texts = prompts(args.num_requests)
    log = Path("benchmarks/results/serve_overhead_server.log")
    log.unlink(missing_ok=True)
    command = tandem_serve_command(shlex.split(args.serve_args))
    # In this process's session, as a server started from a shell is beside its clients.
    with LaunchedServer(command, log, ready_timeout=120, new_session=False) as server:
        base_url, port, pid = server.url, server.port, server.process.pid
        llm = LLM("default")  # both engines idle while the other runs: only one computes at once
        offline_round(llm, texts[:2], 4)  # warm-up
        asyncio.run(server_round(HOST, port, texts[:2], 4))
        offline_rates, server_rates = [], []
        delivery_p50, delivery_p99, cpu_per_token, client_cpu_per_token = [], [], [], []
        for _ in range(args.rounds):
            elapsed, tokens = offline_round(llm, texts, args.max_tokens)
            offline_rates.append(tokens / elapsed)
            before = metric_samples(base_url)
            cpu_before, client_cpu_before = api_cpu_seconds(pid), time.process_time()
            elapsed, tokens = asyncio.run(server_round(HOST, port, texts, args.max_tokens))
            cpu_per_token.append((api_cpu_seconds(pid) - cpu_before) / tokens)
            client_cpu_per_token.append((time.process_time() - client_cpu_before) / tokens)
            after = metric_samples(base_url)
            server_rates.append(tokens / elapsed)
            name = "tandem:token_delivery_seconds"
            delivery_p50.append(histogram_quantile(before, after, name, 0.5))
            delivery_p99.append(histogram_quantile(before, after, name, 0.99))
            print(f"round {len(server_rates)}: offline {offline_rates[-1]:.1f} tok/s, server "
                  f"{server_rates[-1]:.1f} tok/s, delivery p99 <= {delivery_p99[-1] * 1e3:.2f} "
                  "ms", flush=True)  # fmt: skip
    offline, served = statistics.median(offline_rates), statistics.median(server_rates)
    print(f"\n{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"{args.num_requests} streams x {args.max_tokens} tokens, {args.rounds} rounds "
          "alternated, medians\n")  # fmt: skip
    print("| path | output tok/s (each round) | median | vs offline |")
    print("|---|---|---:|---:|")
    print(f"| offline LLM.generate | {', '.join(f'{r:.1f}' for r in offline_rates)} "
          f"| {offline:.1f} | 1.00× |")  # fmt: skip
    print(f"| HTTP server, streaming | {', '.join(f'{r:.1f}' for r in server_rates)} "
          f"| {served:.1f} | {served / offline:.2f}× |")  # fmt: skip
    print(f"\nsampling → SSE write, upper bucket edge: p50 ≤ {max(delivery_p50) * 1e3:.2f} ms, "
          f"p99 ≤ {max(delivery_p99) * 1e3:.2f} ms (worst round)")  # fmt: skip
    print(f"API process CPU per output token: {statistics.median(cpu_per_token) * 1e3:.3f} ms; "
          "the load generator's (raw sockets, in this process, on the same cores): "
          f"{statistics.median(client_cpu_per_token) * 1e3:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
