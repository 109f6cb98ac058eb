"""Serving beside another busy process: one stream's tok/s from `tandem serve`, alone and
beside one CPU-bound process (a Python busy loop) in the benchmark's own session (the server's
too), then in a session of its own, for each set of server flags given.

The forward's OpenMP threads wait at every barrier for the one whose core the other process
shares, so the forward can slow far more than that process's share of the cores; the engine's
answer is fewer forward threads while it waits for cores (`--adapt-cpu-threads`, the default).
Each stream runs for at most `--seconds` (a starved forward may emit a token a second),
greedy, `ignore_eos`.

    .venv/bin/python benchmarks/shared_cores.py [--seconds 20]
        [--serve-args= --serve-args=--no-adapt-cpu-threads ...]  (one server each)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tandem.bench.launch import LaunchedServer, tandem_serve_command

LOG = Path("benchmarks/results/shared_cores_server.log")
BUSY_LOOP = "while True: pass"
SETTLE_SECONDS = 1.0  # after starting or stopping the busy process
DEFAULT_SERVERS = ["", "--no-adapt-cpu-threads"]


def stream_rate(url: str, seconds: float) -> float:
    """Tokens per second of one greedy stream, read for at most `seconds` (a chunk may carry
    several tokens: each chunk's usage counts them)."""
    body = {"model": "default", "prompt": "Write a long essay about the history of tea.",
            "max_tokens": 4096, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    tokens, start = 0, time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=seconds + 60) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                tokens = json.loads(line.removeprefix("data: "))["usage"]["completion_tokens"]
            if time.perf_counter() - start > seconds:
                break
    return tokens / (time.perf_counter() - start)


def busy_process(own_session: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=own_session)


def measure(serve_args: list[str], seconds: float) -> dict[str, float]:
    # In this process's session: the busy process started beside it shares it.
    command = tandem_serve_command(serve_args)
    with LaunchedServer(command, LOG, ready_timeout=120, new_session=False) as server:
        stream_rate(server.url, 2.0)  # warm up
        rates = {"alone": stream_rate(server.url, seconds)}
        for name, own_session in (("same session", False), ("other session", True)):
            busy = busy_process(own_session)
            try:
                time.sleep(SETTLE_SECONDS)
                rates[f"beside a busy process, {name}"] = stream_rate(server.url, seconds)
            finally:
                busy.kill()
                busy.wait()
            time.sleep(SETTLE_SECONDS)
        rates["alone again"] = stream_rate(server.url, seconds)
        return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve-args", action="append",
                        help="a server started with these flags (repeat for more; "
                        f"default: {DEFAULT_SERVERS})")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    servers = args.serve_args or DEFAULT_SERVERS
    results = {flags: measure(shlex.split(flags), args.seconds) for flags in servers}
    columns = list(next(iter(results.values())))
    print(f"\n{datetime.date.today()}, {platform.machine()}, one stream, tok/s")
    print("| server flags | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for flags, rates in results.items():
        name = f"`{flags}`" if flags else "(defaults)"
        print(f"| {name} | " + " | ".join(f"{rates[c]:.1f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
