"""Clients that go away: their requests are aborted in the engine (no request left running or
waiting, every KV block free), and the clients that stayed get complete, correct answers."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from greedy_reference import assert_same_greedy, greedy
from server_process import ServerProcess, scrape_metrics, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

MODEL = "default"
MAX_TOKENS = 32
NUM_CLIENTS = 32
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
    "The best way to learn a language is", "My favourite colour is", "import numpy as np\n",
    "Water boils at", "The three primary colours are", "Dear Sir or Madam,",
    "In 1492, Columbus", "A haiku about autumn:\n", "SELECT * FROM", "The moon is",
    "Photosynthesis is the process", "Here is a list of fruits:",
]  # fmt: skip


@pytest.fixture(scope="module")
def references(offline_llm) -> dict:
    outputs = offline_llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)
    return {prompt: output.outputs[0] for prompt, output in zip(PROMPTS, outputs, strict=True)}


def _aborts(samples: dict[str, float]) -> float:
    return samples["tandem:request_success_total[abort]"]


def _finished(samples: dict[str, float]) -> float:
    return sum(samples[f"tandem:request_success_total[{r}]"] for r in ("stop", "length", "abort"))


async def _stream(client: httpx.AsyncClient, prompt: str, leave_after: int | None) -> dict:
    """One streaming client; it hangs up after `leave_after` events (0: as soon as the
    response starts, before any token), or reads to the end if None."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    events: list = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        if leave_after == 0:
            return {"prompt": prompt, "left": True, "events": events}
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if leave_after is not None and len(events) >= leave_after and payload != "[DONE]":
                return {"prompt": prompt, "left": True, "events": events}
    return {"prompt": prompt, "left": False, "events": events}


async def _hang_up_early(client: httpx.AsyncClient, prompt: str, after_seconds: float) -> dict:
    """A client that gives up after a moment, maybe before the response even starts."""
    try:
        return await asyncio.wait_for(_stream(client, prompt, None), after_seconds)
    except asyncio.TimeoutError:
        return {"prompt": prompt, "left": True, "events": None}


def test_streaming_clients_that_disconnect(default_server: ServerProcess, references):
    rng = random.Random(7)
    leavers = rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 3)
    # how each leaver leaves: at once (before the first token), after k events, or on a timer
    plans: dict[int, tuple[str, float]] = {}
    for position, index in enumerate(leavers):
        if position < 3:
            plans[index] = ("events", 0)
        elif position < 5:
            plans[index] = ("timer", rng.uniform(0.0, 0.3))
        else:
            plans[index] = ("events", rng.randint(1, 20))
    before = scrape_metrics(default_server.url)
    log_aborts_before = default_server.log().count("finish_reason=abort")

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=default_server.url, timeout=120,
                                     limits=limits) as client:  # fmt: skip
            tasks = []
            for index in range(NUM_CLIENTS):
                prompt = PROMPTS[index % len(PROMPTS)]
                kind, value = plans.get(index, ("events", None))
                if kind == "timer":
                    tasks.append(_hang_up_early(client, prompt, value))
                else:
                    tasks.append(_stream(client, prompt, value))
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())

    # Every client that stayed got its whole greedy answer, one finish_reason, then [DONE].
    stayed = [result for result in results if not result["left"]]
    assert len(stayed) >= NUM_CLIENTS - len(leavers)
    for result in stayed:
        events = result["events"]
        assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
        choices = [event["choices"][0] for event in events[:-1]]
        assert all("error" not in event for event in events[:-1])
        text = "".join(choice["text"] for choice in choices)
        token_ids = [t for choice in choices for t in choice.get("token_ids") or []]
        reference = references[result["prompt"]]
        assert_same_greedy(token_ids, text, reference, result["prompt"])
        finish_reasons = [c["finish_reason"] for c in choices if c.get("finish_reason")]
        assert finish_reasons == [reference.finish_reason]

    # Nothing is left in the engine: no request running or waiting, every KV block free.
    after = wait_until_idle(default_server.url, timeout=60)
    left_before_a_token = sum(1 for kind, value in plans.values() if (kind, value) == ("events", 0))
    aborted = _aborts(after) - _aborts(before)
    assert left_before_a_token <= aborted <= len(leavers), aborted
    # each request that reached the engine finished exactly once (the timer ones may not have)
    finished = _finished(after) - _finished(before)
    assert NUM_CLIENTS - 2 <= finished <= NUM_CLIENTS, finished
    log = default_server.wait_for_log("finish_reason=abort")
    assert log.count("finish_reason=abort") - log_aborts_before == aborted

    # The engine is unharmed: the same request again gives the same answer.
    prompt = PROMPTS[0]
    response = httpx.post(
        f"{default_server.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "return_token_ids": True},
        timeout=120,
    )  # fmt: skip
    choice = response.json()["choices"][0]
    assert_same_greedy(choice["token_ids"], choice["text"], references[prompt], "after")


def test_non_streaming_clients_that_disconnect(default_server: ServerProcess):
    """Long non-streaming requests whose clients time out are aborted at once, not run to
    their max_tokens (which would take minutes)."""
    before = scrape_metrics(default_server.url)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 4000,
            "ignore_eos": True, "temperature": 0}  # fmt: skip

    async def run() -> list:
        async with httpx.AsyncClient(base_url=default_server.url, timeout=3) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(4)),
                return_exceptions=True,
            )

    results = asyncio.run(run())
    assert all(isinstance(result, httpx.TimeoutException) for result in results), results
    after = wait_until_idle(default_server.url, timeout=20)
    assert _aborts(after) - _aborts(before) == 4


def test_beam_search_clients_that_disconnect(default_server: ServerProcess):
    """A beam search runs a request per beam per step: a client that goes away (streaming or
    not) stops the search at once; it does not run on to max_tokens."""
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1000, "n": 3,
            "ignore_eos": True, "use_beam_search": True}  # fmt: skip

    async def run() -> list:
        async with httpx.AsyncClient(base_url=default_server.url, timeout=3) as client:
            plain = client.post("/v1/completions", json=body)
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            return await asyncio.gather(plain, streamed, return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(result, httpx.TimeoutException) for result in results), results
    # Every step of a search finishes a request per beam: once idle, none may finish any more
    # (between two steps the engine is idle for a moment too).
    finished = _finished(wait_until_idle(default_server.url, timeout=20))
    time.sleep(2)
    assert _finished(wait_until_idle(default_server.url, timeout=20)) == finished
