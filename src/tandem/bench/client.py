"""The load generator: sends a workload's requests to an OpenAI-compatible server (streaming,
asyncio + httpx) on an arrival schedule, and keeps one record per request with every timestamp.
Nothing is measured here but times and the server's token counts: report.py derives every figure
from the records afterwards.

Times are seconds of `time.perf_counter()` since the run's start. A request is a failure (never
a fast success) if its status is not 200, the connection breaks, the stream carries an error
event, ends before `data: [DONE]` or a finish_reason, or carries no output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tandem.bench.records import RequestRecord
from tandem.bench.workloads import Session, Turn, Workload, arrival_times, text_of

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    ignore_eos: bool = True  # vLLM's extension: outputs are as long as the workload says
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout: float = 6 * 3600.0


class BenchError(RuntimeError):
    """The run cannot start (server unreachable, warm-up failed)."""


# -- request bodies -------------------------------------------------------------------------------


def completion_prompt(session: Session, turn: int, answers: list[str]) -> str | list[int]:
    """The /v1/completions prompt: token ids as they are; text as a transcript (system prompt,
    then "User: ... / Assistant: ..." turns) when the session has a system prompt or history."""
    prompt = session.turns[turn].prompt
    if isinstance(prompt, list):
        return prompt
    if turn == 0 and len(session.turns) == 1:
        return f"{session.system}\n\n{prompt}" if session.system else prompt
    lines = [session.system, ""] if session.system else []
    for past in range(turn):
        lines += [f"User: {session.turns[past].prompt}", f"Assistant: {answers[past]}"]
    lines += [f"User: {prompt}", "Assistant:"]
    return "\n".join(lines)


def chat_messages(session: Session, turn: int, answers: list[str]) -> list[dict[str, str]]:
    if any(isinstance(t.prompt, list) for t in session.turns):
        raise BenchError("token-id prompts need --endpoint completions")
    messages = [{"role": "system", "content": session.system}] if session.system else []
    for past in range(turn):
        messages += [
            {"role": "user", "content": session.turns[past].prompt},
            {"role": "assistant", "content": answers[past]},
        ]
    messages.append({"role": "user", "content": session.turns[turn].prompt})
    return messages


def request_body(
    config: ClientConfig,
    session: Session,
    turn: int,
    answers: list[str],
    output_len: int | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": output_len or session.turns[turn].output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = chat_messages(session, turn, answers)
    else:
        body["prompt"] = completion_prompt(session, turn, answers)
    body.update(config.extra_body)
    return body


# -- one streamed request -------------------------------------------------------------------------


def _chunk_output(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """(text, whether the chunk carries output). A chat chunk that only opens the message with
    the role, and a bare finish marker with no text, carry none."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or ""
        opening = "role" in delta and not text and choice.get("finish_reason") is None
        return text, not opening and (bool(text) or choice.get("finish_reason") is None)
    text = choice.get("text") or ""
    return text, bool(text) or choice.get("finish_reason") is None


async def stream_request(
    http: httpx.AsyncClient,
    config: ClientConfig,
    body: dict[str, Any],
    record: RequestRecord,
    start: float,
) -> str:
    """Send one request and fill `record` in; returns the generated text."""
    chat = config.endpoint == "chat"
    pieces: list[str] = []
    finished = done = False
    record.send = time.perf_counter() - start
    try:
        async with http.stream("POST", ENDPOINTS[config.endpoint], json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return ""
            async for line in response.aiter_lines():
                now = time.perf_counter() - start
                if not line.startswith("data:"):
                    continue  # blank separators and ": keep-alive" comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    continue
                data = json.loads(payload)
                if "error" in data:
                    error = data["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = f"error event in the stream: {message}"
                    break
                if data.get("usage"):
                    record.prompt_tokens = data["usage"].get("prompt_tokens")
                    record.output_tokens = data["usage"].get("completion_tokens")
                for choice in data.get("choices") or []:
                    text, output = _chunk_output(choice, chat)
                    pieces.append(text)
                    finished = finished or choice.get("finish_reason") is not None
                    if output:
                        record.chunks.append(now)
                        break  # one arrival per chunk (n = 1 here)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
    finally:
        record.end = time.perf_counter() - start
    if record.error is None and not (done or finished):
        record.error = "the stream ended before data: [DONE] (dropped mid-way)"
    if record.error is None and not record.chunks:
        record.error = "the stream carried no output"
    return "".join(pieces)


# -- the run --------------------------------------------------------------------------------------


def warmup_session(workload: Workload) -> Session:
    """A 16-token request unlike the workload's prompts (so it warms the server up without
    putting any of them in a prefix cache)."""
    first = workload.sessions[0].turns[0].prompt
    if isinstance(first, list):
        prompt: str | list[int] = list(reversed(first[:16]))
    else:
        prompt = text_of(random.Random("warmup"), 16)
    return Session([Turn(prompt, 16, len(prompt) if isinstance(prompt, list) else 16)])


def make_records(workload: Workload, schedule: list[float]) -> list[list[RequestRecord]]:
    records, index = [], 0
    for number, session in enumerate(workload.sessions):
        row = []
        for turn_number, turn in enumerate(session.turns):
            row.append(
                RequestRecord(
                    index,
                    number,
                    turn_number,
                    session.tag,
                    turn.prompt_len,
                    turn.output_len,
                    schedule[number],
                )
            )
            index += 1
        records.append(row)
    return records


def http_client(config: ClientConfig, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(config.timeout, connect=30.0)
    return httpx.AsyncClient(
        base_url=config.base_url, headers=headers, limits=limits, timeout=timeout
    )


async def first_model(base_url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as http:
        try:
            response = await http.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise BenchError(f"cannot list {base_url}/v1/models to pick a model: {error}") from None


async def run_workload(
    workload: Workload,
    config: ClientConfig,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    progress: bool = True,
) -> tuple[list[RequestRecord], RequestRecord | None]:
    """Run the workload; returns (records in workload order, the warm-up's record)."""
    if workload.self_timed:
        schedule = [session.arrival for session in workload.sessions]
    else:
        schedule = arrival_times(len(workload.sessions), request_rate, burstiness, seed)
    rows = make_records(workload, schedule)
    connections = max_concurrency or max(1, len(workload.sessions))
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=workload.num_requests, desc=f"bench {workload.name}", unit="req")

    async with http_client(config, connections + 1) as http:
        warm = None
        if warmup and workload.sessions:
            warm = RequestRecord(-1, -1, 0, "warmup", 16, 16, 0.0)
            body = request_body(config, warmup_session(workload), 0, [])
            await stream_request(http, config, body, warm, time.perf_counter())
            if not warm.ok:
                raise BenchError(f"the warm-up request failed: {warm.error}")
        start = time.perf_counter()

        async def run_session(session: Session, row: list[RequestRecord]) -> None:
            await asyncio.sleep(max(0.0, start + row[0].scheduled - time.perf_counter()))
            answers: list[str] = []
            for turn, record in enumerate(row):
                if turn:  # a later turn is released when the previous answer is complete
                    record.scheduled = time.perf_counter() - start
                async with gate:
                    body = request_body(config, session, turn, answers)
                    text = await stream_request(http, config, body, record, start)
                if bar is not None:
                    bar.update(1)
                if not record.ok:
                    for later in row[turn + 1 :]:
                        later.scheduled = later.send = later.end = time.perf_counter() - start
                        later.error = "not sent: an earlier turn of its conversation failed"
                        if bar is not None:
                            bar.update(1)
                    return
                answers.append(text)

        try:
            await asyncio.gather(
                *(run_session(s, r) for s, r in zip(workload.sessions, rows, strict=True))
            )
        finally:
            if bar is not None:
                bar.close()
    return [record for row in rows for record in row], warm
