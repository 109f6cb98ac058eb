"""Prefill/decode disaggregation end to end, on CPU over loopback: a `--role prefill` instance,
a `--role decode` instance and `tandem router` in front of them must answer exactly what one
co-located (`--role both`) instance answers, the decode instance must never compute a prompt
token for a split request, and no KV block may stay held, on either side, after requests end,
are aborted, or lose their prefill instance."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem.bench.launch import free_port

from server_process import (
    ServerProcess,
    _alive,
    assert_openai_error,
    child_pids,
    cmdline,
    scrape_metrics,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

MODEL = "default"
BLOCK_SIZE = 16  # the servers' default
HOLD_SECONDS = 8  # the prefill instance's --kv-hold-seconds: holds nobody pulls expire soon
LOADED = "tandem:kv_transfer_loaded_requests_total"
FAILED = "tandem:kv_transfer_failed_requests_total"
LOADED_BLOCKS = "tandem:kv_transfer_loaded_blocks_total"
CACHED_BLOCKS = "tandem:kv_transfer_cached_blocks_total"
SENT = "tandem:kv_transfer_sent_requests_total"
SENT_BLOCKS = "tandem:kv_transfer_sent_blocks_total"
EXPIRED = "tandem:kv_transfer_expired_requests_total"
HELD = "tandem:kv_transfer_held_blocks"
USAGE = "tandem:kv_cache_usage_perc"

_SENTENCES = [
    "The harbour town woke slowly under a grey sky while fishing boats returned with nets.",
    "A committee of engineers met on Tuesday to review the bridge inspection reports.",
    "In the old library, a cat slept on a pile of atlases nobody had opened in years.",
    "The recipe calls for two cups of flour, a pinch of salt and three ripe bananas.",
    "Astronomers announced that the comet would be visible just after sunset next week.",
    "Her grandfather kept bees behind the orchard and sold honey at the Saturday market.",
    "The train to the mountains leaves at seven and stops at every village on the way.",
    "After the storm, volunteers cleared fallen branches from the roads around the school.",
]


def long_prompt(index: int, num_sentences: int = 5) -> str:
    """A prompt of several 16-token blocks, different from its first token on for each index;
    it ends mid-sentence, so the model goes on (a question makes it stop at once: EOS)."""
    sentences = [_SENTENCES[(index + k) % len(_SENTENCES)] for k in range(num_sentences)]
    return f"Story {index}. " + " ".join(sentences) + " Then, the"


# -- instances -------------------------------------------------------------------------------


def free_kv_port() -> int:
    """A free port whose successor is free too (a prefill instance binds both)."""
    for _ in range(50):
        port = free_port()
        if port + 1 >= 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


def prefill_args(hold_seconds: float = HOLD_SECONDS) -> tuple[str, ...]:
    return (
        "--role",
        "prefill",
        "--kv-port",
        str(free_kv_port()),
        "--kv-hold-seconds",
        str(hold_seconds),
    )


def router_process(
    log_dir: Path, prefill: list[str], decode: list[str], *args: str, name: str = "router"
) -> ServerProcess:
    return ServerProcess(
        "--prefill",
        *prefill,
        "--decode",
        *decode,
        *args,
        log_dir=log_dir,
        name=name,
        command="router",
    )


@pytest.fixture(scope="module")
def _instances(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """One prefill, one decode and one co-located instance, started side by side (each loads
    the model), and a router in front of the first two; shared by the module."""
    log_dir = tmp_path_factory.mktemp("disaggregation")
    step_log = log_dir / "decode-steps.jsonl"
    servers = {
        "prefill": ServerProcess(*prefill_args(), log_dir=log_dir, name="prefill"),
        "decode": ServerProcess(
            "--role",
            "decode",
            "--kv-transfer-timeout",
            "10",
            "--step-log",
            str(step_log),
            log_dir=log_dir,
            name="decode",
        ),
        "colocated": ServerProcess(log_dir=log_dir, name="colocated"),
    }
    with ExitStack() as stack:
        for server in servers.values():
            stack.callback(server.stop)
        ServerProcess.start_together(servers.values())
        router = router_process(
            log_dir, [servers["prefill"].url], [servers["decode"].url], "--poll-interval", "0.5"
        )
        stack.callback(router.stop)
        router.start()
        yield {**servers, "router": router, "step_log": step_log, "log_dir": log_dir}


@pytest.fixture(scope="module")
def prefill(_instances) -> ServerProcess:
    return _instances["prefill"]


@pytest.fixture(scope="module")
def decode(_instances) -> ServerProcess:
    return _instances["decode"]


@pytest.fixture(scope="module")
def colocated(_instances) -> ServerProcess:
    return _instances["colocated"]


@pytest.fixture(scope="module")
def router(_instances) -> ServerProcess:
    return _instances["router"]


@pytest.fixture(scope="module")
def step_log(_instances) -> Path:
    return _instances["step_log"]


# -- helpers ---------------------------------------------------------------------------------


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url, api_key="unused", timeout=120, max_retries=0
    )


def post(server: ServerProcess, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def prefill_leg(prefill: ServerProcess, body: dict) -> dict[str, Any]:
    """What the router does first: the prompt and first token on the prefill instance; its
    kv_transfer_params."""
    leg = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    response = post(prefill, "/v1/completions", leg)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert isinstance(params, dict) and params["do_remote_prefill"] is True, params
    return params


def wait_metrics(
    server: ServerProcess,
    done: Callable[[dict[str, float]], bool],
    timeout: float = 10.0,
) -> dict[str, float]:
    """Scrape /metrics until `done` holds (the engine reports its counters a moment after the
    response); the last scrape either way, for the caller's asserts to show."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape_metrics(server.url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def idle_and_unheld(samples: dict[str, float]) -> bool:
    return all(
        samples[name] == 0
        for name in (USAGE, HELD, "tandem:num_requests_running", "tandem:num_requests_waiting")
    )


def step_records(step_log: Path) -> list[dict]:
    return [json.loads(line) for line in step_log.read_text().splitlines() if line.strip()]


def assert_same_completion(got: Any, want: Any) -> None:
    """Same text, finish reason, token counts and (if asked) logprobs as the reference."""
    assert len(got.choices) == len(want.choices) == 1
    g, w = got.choices[0], want.choices[0]
    assert g.text == w.text
    assert g.finish_reason == w.finish_reason
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    if w.logprobs is not None:
        assert g.logprobs is not None
        assert g.logprobs.tokens == w.logprobs.tokens
        assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-4)
        assert [sorted(t) for t in g.logprobs.top_logprobs] == [
            sorted(t) for t in w.logprobs.top_logprobs
        ]


def assert_same_body(got: dict, want: dict) -> None:
    """The same for raw completion bodies (httpx)."""
    (g,), (w,) = got["choices"], want["choices"]
    assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


# -- the same answers as one co-located instance ---------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 1234},
        {"temperature": 0.9, "top_p": 0.9, "seed": 99, "logprobs": 3},
        {"temperature": 0, "logprobs": 2},
    ],
    ids=["greedy", "seeded", "seeded-logprobs", "greedy-logprobs"],
)
def test_completions_through_the_router_equal_the_colocated_server(
    router: ServerProcess, colocated: ServerProcess, sampling: dict
) -> None:
    """Greedy and seeded sampling (the seeded generator's state travels with the KV), with
    logprobs of every token, the first one the prefill instance's."""
    kwargs = dict(model=MODEL, prompt=long_prompt(1), max_tokens=20, **sampling)
    want = client(colocated).completions.create(**kwargs)
    got = client(router).completions.create(**kwargs)
    assert want.usage.prompt_tokens > 3 * BLOCK_SIZE
    assert want.usage.completion_tokens > 1
    assert_same_completion(got, want)


def test_chat_through_the_router_streamed_and_not(
    router: ServerProcess, colocated: ServerProcess
) -> None:
    messages = [{"role": "user", "content": "Write two sentences about the sea. " + long_prompt(2)}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0.8, seed=5)
    want = client(colocated).chat.completions.create(**kwargs)
    got = client(router).chat.completions.create(**kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > 2 * BLOCK_SIZE
    assert got.usage.completion_tokens == want.usage.completion_tokens

    chunks = list(
        client(router).chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == want.choices[0].message.content
    assert reasons == [want.choices[0].finish_reason]
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_concurrent_requests_through_the_router(
    router: ServerProcess, colocated: ServerProcess, decode: ServerProcess, prefill: ServerProcess
) -> None:
    """Eight requests at once, greedy and seeded, long prompts: each its own answer."""
    requests = [
        dict(
            model=MODEL,
            prompt=long_prompt(10 + i, 4 + i % 3),
            max_tokens=12 + i,
            **({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i}),
        )
        for i in range(8)
    ]

    async def run(server: ServerProcess) -> list:
        async with async_client(server) as api:
            return await asyncio.gather(*(api.completions.create(**r) for r in requests))

    before, router_before = decode.metrics(), router.metrics()
    wants = asyncio.run(run(colocated))
    gots = asyncio.run(run(router))
    for got, want in zip(gots, wants, strict=True):
        assert_same_completion(got, want)
    router_after = router.metrics()
    # Each request split in two legs: one to the prefill instance, one to the decode instance.
    legs = "tandem_router:requests_total"
    assert router_after[legs] - router_before[legs] == 2 * len(requests)
    assert router_after.get("tandem_router:instance_failures_total", 0) == 0
    samples = wait_metrics(decode, lambda s: s[LOADED] >= before[LOADED] + len(requests))
    assert samples[LOADED] - before[LOADED] == len(requests)
    assert samples[FAILED] == before[FAILED]
    assert idle_and_unheld(wait_metrics(prefill, idle_and_unheld))


# -- the decode instance computes no prompt --------------------------------------------------


def test_decode_instance_runs_zero_prefill_tokens(
    router: ServerProcess, decode: ServerProcess, prefill: ServerProcess, step_log: Path
) -> None:
    """Split requests cost the decode instance decode tokens only: one per output token after
    the first (which the prefill instance sampled), and the KV it pulled covers every prompt
    block; the prefill instance sent exactly those blocks. The router sent both legs at once
    (the prefill instance publishes its KV endpoint), so the KV streamed."""
    num_steps_before = len(step_records(step_log))
    decode_before, prefill_before = decode.metrics(), prefill.metrics()
    streamed_before = router.metrics().get("tandem_router:streamed_requests_total", 0)
    api = client(router)
    responses = [
        api.completions.create(
            model=MODEL, prompt=long_prompt(20 + i), max_tokens=10, temperature=0
        )
        for i in range(3)
    ]
    expected_blocks = sum(-(-r.usage.prompt_tokens // BLOCK_SIZE) for r in responses)
    decode_after = wait_metrics(decode, lambda s: s[LOADED] >= decode_before[LOADED] + 3)
    prefill_after = wait_metrics(prefill, lambda s: s[SENT] >= prefill_before[SENT] + 3)

    steps = step_records(step_log)[num_steps_before:]
    assert sum(s["num_prefill_tokens"] for s in steps) == 0
    assert sum(s["num_decode_tokens"] for s in steps) == sum(
        r.usage.completion_tokens - 1 for r in responses
    )
    assert decode_after[LOADED] - decode_before[LOADED] == 3
    assert decode_after[FAILED] == decode_before[FAILED]
    assert decode_after[LOADED_BLOCKS] - decode_before[LOADED_BLOCKS] == expected_blocks
    assert decode_after[CACHED_BLOCKS] == decode_before[CACHED_BLOCKS]  # new prompts
    assert prefill_after[SENT] - prefill_before[SENT] == 3
    assert prefill_after[SENT_BLOCKS] - prefill_before[SENT_BLOCKS] == expected_blocks
    assert idle_and_unheld(wait_metrics(prefill, idle_and_unheld))
    assert router.metrics()["tandem_router:streamed_requests_total"] == streamed_before + 3


def test_repeated_prompt_is_not_transferred_again(
    router: ServerProcess, colocated: ServerProcess, decode: ServerProcess, step_log: Path
) -> None:
    """The decode instance's prefix cache keeps a prompt's pulled blocks: the same prompt again
    pulls only the partly filled last block, and still computes no prompt token."""
    kwargs = dict(model=MODEL, prompt=long_prompt(30, 6), max_tokens=8, temperature=0)
    api = client(router)
    first_before = decode.metrics()
    first = api.completions.create(**kwargs)
    num_prompt_tokens = first.usage.prompt_tokens
    full_blocks = num_prompt_tokens // BLOCK_SIZE
    partial = 1 if num_prompt_tokens % BLOCK_SIZE else 0
    before = wait_metrics(decode, lambda s: s[LOADED] > first_before[LOADED])
    assert before[LOADED_BLOCKS] - first_before[LOADED_BLOCKS] == full_blocks + partial
    num_steps_before = len(step_records(step_log))

    second = api.completions.create(**kwargs)
    after = wait_metrics(decode, lambda s: s[CACHED_BLOCKS] >= before[CACHED_BLOCKS] + full_blocks)
    assert full_blocks >= 4
    assert after[CACHED_BLOCKS] - before[CACHED_BLOCKS] == full_blocks
    assert after[LOADED_BLOCKS] - before[LOADED_BLOCKS] == partial
    assert after[FAILED] == before[FAILED]
    steps = step_records(step_log)[num_steps_before:]
    assert sum(s["num_prefill_tokens"] for s in steps) == 0
    want = client(colocated).completions.create(**kwargs)
    assert_same_completion(first, want)
    assert_same_completion(second, want)


# -- requests that end at their first token --------------------------------------------------


def test_request_ending_at_its_first_token(
    router: ServerProcess, colocated: ServerProcess, prefill: ServerProcess, decode: ServerProcess
) -> None:
    """A stop string or stop token id matching the first token: the answer equals the
    co-located one, and the prefill instance frees the prompt's blocks at once (the decode
    instance pulls or releases them; they do not wait for the hold to expire)."""
    prompt = long_prompt(40)
    first = post(
        colocated,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "return_token_ids": True,
        },
    ).json()["choices"][0]
    first_text, (first_id,) = first["text"], first["token_ids"]
    assert first_text.strip(), "the prompt's first greedy token should be visible text"
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    # The first token is EOS after a question (checked on the co-located answer below).
    question = {"prompt": prompt.removesuffix(" Then, the") + " What happens next?"}
    for extra in ({"stop": [first_text]}, {"stop_token_ids": [first_id]}, question):
        prefill_before = prefill.metrics()
        body = {**base, **extra}
        want = post(colocated, "/v1/completions", body).json()
        got = post(router, "/v1/completions", body)
        assert got.status_code == 200, got.text
        assert want["choices"][0]["finish_reason"] == "stop"
        assert want["usage"]["completion_tokens"] == 1
        assert_same_body(got.json(), want)
        start = time.monotonic()
        prefill_after = wait_metrics(prefill, idle_and_unheld, timeout=HOLD_SECONDS)
        assert idle_and_unheld(prefill_after), extra
        assert time.monotonic() - start < HOLD_SECONDS / 2, "freed by expiry, not release"
        assert prefill_after[EXPIRED] == prefill_before[EXPIRED]
        assert idle_and_unheld(wait_metrics(decode, idle_and_unheld))


# -- bad input --------------------------------------------------------------------------------


def wait_router_healthy(router: ServerProcess, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{router.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the router has no healthy instance of a role"
        time.sleep(0.2)


def refusal_problem(
    name: str, response: httpx.Response, message: str | None = None, param: Any = ...
) -> str | None:
    """None if `response` is OpenAI's 400 (naming `message` and `param` if given); otherwise
    what is wrong, so that one test run lists every case."""
    try:
        error = assert_openai_error(response, 400, param)
    except AssertionError as failure:
        return f"{name}: {failure}"
    if message is not None and message not in error["message"]:
        return f"{name}: {message!r} not in {error['message']!r}"
    return None


def test_misdirected_or_broken_kv_transfer_params_are_refused(
    prefill: ServerProcess,
    decode: ServerProcess,
    colocated: ServerProcess,
    router: ServerProcess,
) -> None:
    """Each instance refuses what its role cannot do with a 400 that says what to change; a
    decode instance refuses params made for another prompt (and then still accepts the real
    ones); a client's bad params through the router are the client's error, so the router keeps
    the decode instance in rotation."""
    body = {"model": MODEL, "prompt": long_prompt(50), "max_tokens": 6, "temperature": 0}
    remote_decode = {"do_remote_decode": True}
    one_token = {**body, "max_tokens": 1}
    completions = "/v1/completions"
    problems = [
        refusal_problem(
            "do_remote_prefill to --role both",
            post(colocated, completions,
                 {**body, "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}}),
            "--role decode",
        ),
        refusal_problem(
            "do_remote_decode to --role both",
            post(colocated, completions, {**one_token, "kv_transfer_params": remote_decode}),
            "--role prefill",
        ),
        refusal_problem(
            "do_remote_decode to --role decode",
            post(decode, completions, {**one_token, "kv_transfer_params": remote_decode}),
            "--role prefill",
        ),
        refusal_problem(
            "do_remote_decode streamed",
            post(prefill, completions,
                 {**one_token, "stream": True, "kv_transfer_params": remote_decode}),
            param="stream",
        ),
        refusal_problem(
            "do_remote_decode with max_tokens 6",
            post(prefill, completions, {**body, "kv_transfer_params": remote_decode}),
            "max_tokens 1",
        ),
        refusal_problem(
            "do_remote_decode with n=2",
            post(prefill, completions, {**one_token, "n": 2, "kv_transfer_params": remote_decode}),
            param="n",
        ),
    ]  # fmt: skip

    params = prefill_leg(prefill, body)
    tampered = [
        ("another prompt", {**body, "prompt": long_prompt(51)}, params, "other prompt tokens"),
        ("another digest", body, {**params, "prompt_digest": "0" * 32}, "other prompt tokens"),
        ("a block short", body,
         {**params, "remote_block_ids": params["remote_block_ids"][:-1]}, "do not cover"),
        ("an unknown key", body, {**params, "surprise": 1}, "unknown keys: surprise"),
        ("no remote_host", body,
         {k: v for k, v in params.items() if k != "remote_host"}, "lacks remote_host"),
        ("n=2", {**body, "n": 2}, params, "n=1"),
    ]  # fmt: skip
    for name, request, kv_params, message in tampered:
        response = post(decode, completions, {**request, "kv_transfer_params": kv_params})
        problems.append(refusal_problem(f"decode leg with {name}", response, message))

    # Nothing was taken by the refusals: the real decode leg still pulls and answers right.
    decode_before = decode.metrics()
    got = post(decode, completions, {**body, "kv_transfer_params": params})
    assert got.status_code == 200, got.text
    assert_same_body(got.json(), post(colocated, completions, body).json())
    after = wait_metrics(decode, lambda s: s[LOADED] > decode_before[LOADED])
    assert after[LOADED] == decode_before[LOADED] + 1 and after[FAILED] == decode_before[FAILED]

    bad = {**body, "kv_transfer_params": {**params, "prompt_digest": "0" * 32}}
    problems.append(
        refusal_problem("the router, bad client params", post(router, completions, bad))
    )
    health = httpx.get(f"{router.url}/health", timeout=10)
    state = health.json()
    listed = sorted((i["role"], i["url"], i["healthy"]) for i in state["instances"])
    if health.status_code != 200 or listed != [
        ("decode", decode.url, True),
        ("prefill", prefill.url, True),
    ]:
        problems.append(f"router /health after a client's bad params: {state}")
    problems = [problem for problem in problems if problem is not None]
    wait_router_healthy(router)  # whatever happened, later tests need both instances in rotation
    assert not problems, "\n".join(problems)


# -- aborts leave nothing held ---------------------------------------------------------------


def test_aborted_requests_leave_no_blocks_held(
    router: ServerProcess, prefill: ServerProcess, decode: ServerProcess, colocated: ServerProcess
) -> None:
    """Clients that hang up mid-stream (the decode leg is aborted) or during the prefill leg
    (the prefill instance aborts it, or its hold expires unpulled): both instances get every
    block back, and the next request is still answered right."""

    async def leave_mid_stream(api: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": MODEL,
            "prompt": long_prompt(60 + index),
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
        events = 0
        async with api.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break
        return events

    async def leave_during_prefill(api: httpx.AsyncClient, index: int) -> bool:
        body = {
            "model": MODEL,
            "prompt": long_prompt(70 + index, 24),
            "max_tokens": 16,
            "temperature": 0,
        }
        try:
            await api.post("/v1/completions", json=body, timeout=0.05)
        except httpx.TimeoutException:
            return True
        return False

    async def run() -> tuple[list[int], list[bool]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as api:
            streams = asyncio.gather(*(leave_mid_stream(api, i) for i in range(4)))
            early = asyncio.gather(*(leave_during_prefill(api, i) for i in range(4)))
            return await streams, await early

    streamed, timed_out = asyncio.run(run())
    assert streamed == [3] * 4
    assert all(timed_out), timed_out
    limit = HOLD_SECONDS + 15
    for server in (prefill, decode):
        samples = wait_metrics(server, idle_and_unheld, timeout=limit)
        state = {name: samples[name] for name in (USAGE, HELD, "tandem:num_requests_running")}
        assert idle_and_unheld(samples), f"{server.name} still holds KV {limit} s on: {state}"
    aborted = decode.metrics()["tandem:request_success_total[abort]"]
    assert aborted >= 4  # the mid-stream leavers' decode legs

    kwargs = dict(model=MODEL, prompt=long_prompt(3), max_tokens=10, temperature=0)
    assert_same_completion(
        client(router).completions.create(**kwargs), client(colocated).completions.create(**kwargs)
    )


# -- a prefill instance dies ------------------------------------------------------------------


def kill_process_group(server: ServerProcess) -> None:
    """SIGKILL the server and its engine core (it leads its own process group), and wait
    until none of them is left: the KV control socket and pair groups die with the core."""
    children = child_pids(server.pid)
    assert any("spawn_main" in cmdline(pid) for pid in children), children
    os.killpg(server.pid, signal.SIGKILL)
    assert server.wait(10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children):
        assert time.monotonic() < deadline, f"children of {server.name} outlived SIGKILL"
        time.sleep(0.1)


def test_killed_prefill_instance_loses_no_request(
    server_factory,
    prefill: ServerProcess,
    decode: ServerProcess,
    colocated: ServerProcess,
) -> None:
    """A decode leg whose prefill instance died after answering computes the prompt itself
    (one failed pull) and answers what the co-located instance answers, as does a decode leg
    streaming from it when it dies mid-prompt, and one naming the dead instance, at once; a
    router with two prefill instances, one of them dead, sends every prefill leg to the live
    one."""
    victim_args = prefill_args()
    victim = server_factory.start(*victim_args, name="prefill-victim")
    second_router = server_factory.start(
        "--prefill", victim.url, prefill.url, "--decode", decode.url, "--poll-interval", "60",
        "--no-kv-streaming", name="router-two-prefills", command="router",
    )  # fmt: skip

    # A split request by hand forms the decode instance's pair group with the victim.
    warm = {"model": MODEL, "prompt": long_prompt(80), "max_tokens": 6, "temperature": 0}
    before = decode.metrics()
    answer = post(
        decode, "/v1/completions", {**warm, "kv_transfer_params": prefill_leg(victim, warm)}
    )
    assert answer.status_code == 200, answer.text
    assert_same_body(answer.json(), post(colocated, "/v1/completions", warm).json())
    after = wait_metrics(decode, lambda s: s[LOADED] > before[LOADED])
    assert after[LOADED] == before[LOADED] + 1 and after[FAILED] == before[FAILED]

    # The victim answers a prefill leg, then dies before the decode leg pulls the KV.
    body = {
        "model": MODEL,
        "prompt": long_prompt(81),
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": 3,
        "logprobs": 1,
    }
    params = prefill_leg(victim, body)
    ended = after[FAILED] + after[LOADED]
    # And the victim dies while it computes a long prompt whose decode leg streams from it.
    long_body = {"model": MODEL, "prompt": long_prompt(82, 60), "max_tokens": 6,
                 "temperature": 0}  # fmt: skip
    victim_kv_port = int(victim_args[victim_args.index("--kv-port") + 1])
    stream_params = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                     "remote_port": victim_kv_port, "transfer_id": "cut-short"}  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(
            post, decode, "/v1/completions", {**long_body, "kv_transfer_params": stream_params}
        )
        pool.submit(
            post, victim, "/v1/completions",
            {**long_body, "max_tokens": 1,
             "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "cut-short"}},
        )  # fmt: skip
        time.sleep(0.3)  # the victim has the prompt and the decode instance waits on it
        kill_process_group(victim)
        answer = streamed.result()
    assert answer.status_code == 200, answer.text
    assert_same_body(answer.json(), post(colocated, "/v1/completions", long_body).json())

    answer = post(decode, "/v1/completions", {**body, "kv_transfer_params": params})
    assert answer.status_code == 200, answer.text
    want = post(colocated, "/v1/completions", body).json()
    assert_same_body(answer.json(), want)
    got_lp = answer.json()["choices"][0]["logprobs"]
    want_lp = want["choices"][0]["logprobs"]
    assert got_lp["tokens"] == want_lp["tokens"]
    assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-4)
    # The streamed leg failed too, unless the prompt was done before the kill.
    failed = wait_metrics(decode, lambda s: s[FAILED] + s[LOADED] >= ended + 2)
    assert failed[FAILED] + failed[LOADED] == ended + 2
    assert failed[FAILED] >= after[FAILED] + 1

    # A streamed decode leg (the router sends it with its prefill leg) naming the dead
    # instance: its refused connection sends the prompt to a local prefill without waiting.
    started = time.monotonic()
    answer = post(
        decode, "/v1/completions",
        {**body, "kv_transfer_params": {**stream_params, "transfer_id": "to-the-dead"}},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert time.monotonic() - started < 15  # the transfer timeout is 30 s
    assert_same_body(answer.json(), want)
    failed = wait_metrics(decode, lambda s: s[FAILED] + s[LOADED] >= ended + 3)
    assert failed[FAILED] + failed[LOADED] == ended + 3
    assert failed[FAILED] >= after[FAILED] + 2

    # The router still believes the victim healthy (it polls once a minute): its legs fail
    # over to the live prefill instance.
    requests = [
        dict(model=MODEL, prompt=long_prompt(90 + i), max_tokens=8, temperature=0) for i in range(4)
    ]

    async def run(server: ServerProcess) -> list:
        async with async_client(server) as api:
            return await asyncio.gather(*(api.completions.create(**r) for r in requests))

    loaded_before = decode.metrics()
    gots = asyncio.run(run(second_router))
    wants = asyncio.run(run(colocated))
    for got, want in zip(gots, wants, strict=True):
        assert_same_completion(got, want)
    router_samples = second_router.metrics()
    assert router_samples["tandem_router:instance_failures_total"] >= 1
    health = httpx.get(f"{second_router.url}/health", timeout=10).json()
    by_url = {i["url"]: i for i in health["instances"]}
    assert by_url[victim.url]["healthy"] is False and by_url[victim.url]["num_failures"] >= 1
    assert by_url[prefill.url]["healthy"] is True
    assert health["healthy"] is True
    after_router = wait_metrics(
        decode, lambda s: s[LOADED] >= loaded_before[LOADED] + len(requests)
    )
    assert after_router[LOADED] - loaded_before[LOADED] == len(requests)
    assert after_router[FAILED] == loaded_before[FAILED]
