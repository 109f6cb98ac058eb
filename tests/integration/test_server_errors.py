"""Requests the server must refuse, and how: the status code, OpenAI's error body with `param`
naming the field to change, and the limits set on the command line (API key, body size, queue
length)."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import openai
import pytest

from server_process import (
    ServerProcess,
    assert_openai_error,
    parse_metrics,
    simultaneous_posts,
    wait_until_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

MODEL = "default"
API_KEY = "test-key-3f9a"
MAX_REQUEST_BYTES = 4096


@pytest.fixture(scope="module")
def http(default_server: ServerProcess) -> httpx.Client:
    with httpx.Client(base_url=default_server.url, timeout=120) as http:
        yield http


@pytest.fixture(scope="module")
def max_model_len(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory) -> ServerProcess:
    """One engine seat, one waiting place, a small body limit and an API key."""
    with ServerProcess(
        "--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--max-waiting", "1", "--max-num-seqs", "1",
        log_dir=tmp_path_factory.mktemp("limited"), name="limited-server",
    ) as server:  # fmt: skip
        yield server


# -- 400: the body says what to change ------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    ("max_tokens=0", {"max_tokens": 0}, "max_tokens"),
    ("temperature=-1", {"temperature": -1}, "temperature"),
    ("top_p=0", {"top_p": 0}, "top_p"),
    ("top_p=1.5", {"top_p": 1.5}, "top_p"),
    ("max_tokens string", {"max_tokens": "5"}, "max_tokens"),
    ("temperature string", {"temperature": "0.5"}, "temperature"),
    ("stream int", {"stream": 1}, "stream"),
    ("unknown field", {"frobnicate": 1}, "frobnicate"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("prompt of mixed types", {"prompt": ["a", 1]}, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, "prompt"),
    ("token id past the vocabulary", {"prompt": [1, 10**7]}, "prompt"),
    ("n=0", {"n": 0}, "n"),
    ("logprobs=21", {"logprobs": 21}, "logprobs"),
    ("top_k=-2", {"top_k": -2}, "top_k"),
    ("min_p=2", {"min_p": 2}, "min_p"),
    ("empty stop string", {"stop": [""]}, "stop"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}},
     "stream_options"),
    ("unsupported field", {"structural_tag": "{}"}, "structural_tag"),
    ("logit_bias key not a token id", {"logit_bias": {"x": 5}}, "logit_bias"),
    ("logit_bias past the vocabulary", {"logit_bias": {"99999999": 5}}, "logit_bias"),
    ("truncate_prompt_tokens past max_model_len", {"truncate_prompt_tokens": 10**9},
     "truncate_prompt_tokens"),
    ("prompt_logprobs=-1 over the limit", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("model not a string", {"model": 5}, "model"),
]  # fmt: skip

BAD_CHATS = [
    ("empty messages", {"messages": []}, "messages"),
    ("no messages", {"messages": None}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
    ("user without content", {"messages": [{"role": "user"}]}, "messages"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("max_completion_tokens=0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("temperature=-1", {"temperature": -1}, "temperature"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs=21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("tools, no --enable-auto-tool-choice", {"tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice"),
    ("tool_choice required and a response_format", {
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
        "response_format": {"type": "json_object"}}, "tool_choice"),
    ("unknown field", {"frobnicate": True}, "frobnicate"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "change", "param"), BAD_COMPLETIONS,
                         ids=[case[0] for case in BAD_COMPLETIONS])  # fmt: skip
def test_bad_completion_is_400_naming_the_field(http, name, change, param):
    response = http.post("/v1/completions", json={**COMPLETION, **change})
    error = assert_openai_error(response, 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("name", "change", "param"), BAD_CHATS,
                         ids=[case[0] for case in BAD_CHATS])  # fmt: skip
def test_bad_chat_is_400_naming_the_field(http, name, change, param):
    response = http.post("/v1/chat/completions", json={**CHAT, **change})
    assert_openai_error(response, 400, param)


def test_openai_client_sees_the_param(default_server):
    client = openai.OpenAI(base_url=default_server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=-1)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=CHAT["messages"], max_tokens=4)
    assert caught.value.param == "model" and caught.value.code == "model_not_found"


def test_over_the_context_length_says_by_how_much(http, max_model_len):
    """prompt + max_tokens over max_model_len: 400, and the message has the numbers needed to
    fix the request."""
    prompt = [100] * (max_model_len - 100)
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": prompt,
                                                  "max_tokens": 150})  # fmt: skip
    error = assert_openai_error(response, 400, "max_tokens")
    assert "150" in error["message"] and "100" in error["message"], error
    # a chat asking for more than the whole context
    response = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": max_model_len + 1})
    error = assert_openai_error(response, 400, "max_tokens")
    assert str(max_model_len + 1) in error["message"], error
    # a prompt that alone fills the context
    for length in (max_model_len, max_model_len + 50):
        response = http.post("/v1/completions", json={**COMPLETION, "prompt": [100] * length})
        error = assert_openai_error(response, 400, "prompt")
        assert str(length) in error["message"], error
        assert str(max_model_len) in error["message"], error


def test_text_that_is_not_unicode_is_400(http):
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which no tokenizer can encode."""
    bad = "a\ud800b"
    messages = [{"role": "user", "content": bad}]
    for path, body, param in (
        ("/v1/completions", {**COMPLETION, "prompt": bad}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": ["ok", bad]}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": messages}, "messages"),
        ("/tokenize", {"prompt": bad}, "prompt"),
        ("/tokenize", {"messages": messages}, "messages"),
    ):
        raw = json.dumps(body).encode()  # ASCII with a \\ud800 escape: valid JSON
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert_openai_error(response, 400, param)


@pytest.mark.parametrize(
    "change",
    [{"chat_template": "{% if %}"}, {"chat_template": "{{ raise_exception('no') }}"},
     {"chat_template_kwargs": {"tokenize": True}},
     {"chat_template_kwargs": {"add_generation_prompt": False}}],
    ids=["syntax error", "raises", "tokenize kwarg", "duplicate kwarg"],
)  # fmt: skip
def test_chat_template_that_cannot_render_is_400(http, change):
    """The template renders in the API process from what the request says; when it cannot,
    that is the request's fault, on /tokenize as on /v1/chat/completions."""
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/tokenize", {"messages": CHAT["messages"]}),
    ):
        error = assert_openai_error(http.post(path, json={**body, **change}), 400, "messages")
        assert "chat template" in error["message"], error


def test_request_chat_template_needs_the_servers_trust(limited_server):
    """A chat template is code the server runs; without --trust-request-chat-template a
    request's own is refused with what to do, and the model's template still serves."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/tokenize", {"messages": CHAT["messages"]}),
    ):
        for change in ({"chat_template": template},
                       {"chat_template_kwargs": {"chat_template": template}}):  # fmt: skip
            response = httpx.post(f"{limited_server.url}{path}", json={**body, **change},
                                  headers=headers, timeout=120)  # fmt: skip
            error = assert_openai_error(response, 400, "chat_template")
            assert "--trust-request-chat-template" in error["message"], error
    response = httpx.post(f"{limited_server.url}/tokenize", json={"messages": CHAT["messages"]},
                          headers=headers, timeout=120)  # fmt: skip
    assert response.status_code == 200 and response.json()["count"] > 0


# -- 404, 405 -----------------------------------------------------------------------------


def test_unknown_model_and_path_are_404(http):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        response = http.post(path, json={**body, "model": "no-such-model"})
        error = assert_openai_error(response, 404, "model")
        assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/")):
        error = assert_openai_error(http.request(method, path), 404)
        assert error["type"] == "not_found_error"
    assert_openai_error(http.get("/v1/completions"), 405)


# -- limits set on the command line ----------------------------------------------------------


def test_api_key(limited_server):
    url = limited_server.url
    post = functools.partial(httpx.post, timeout=120)
    good = {"Authorization": f"Bearer {API_KEY}"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):  # fmt: skip
        response = post(f"{url}/v1/completions", json=COMPLETION, headers=headers)
        error = assert_openai_error(response, 401)
        assert error["type"] == "authentication_error"
        assert_openai_error(httpx.get(f"{url}/v1/models", headers=headers, timeout=30), 401)
    assert post(f"{url}/v1/completions", json=COMPLETION, headers=good).status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # probes carry no key
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    client = openai.OpenAI(base_url=limited_server.base_url, api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text
    wrong = openai.OpenAI(base_url=limited_server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_body_over_the_limit_is_413(limited_server):
    url = f"{limited_server.url}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {**COMPLETION, "prompt": "word " * MAX_REQUEST_BYTES}
    assert_openai_error(httpx.post(url, json=big, headers=headers, timeout=30), 413)

    def chunked():  # no Content-Length: the limit is enforced as the body arrives
        body = httpx.Request("POST", url, json=big).content
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    assert_openai_error(httpx.post(url, content=chunked(), headers=headers, timeout=30), 413)
    # just under the limit is fine, and the server is unharmed
    fits = {**COMPLETION, "prompt": "word " * ((MAX_REQUEST_BYTES - 200) // 5)}
    assert len(httpx.Request("POST", url, json=fits).content) < MAX_REQUEST_BYTES
    response = httpx.post(url, json={**fits, "max_tokens": 1}, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    assert httpx.get(f"{limited_server.url}/health", timeout=30).status_code == 200


def _check_admitted_or_refused(responses: list[httpx.Response], max_tokens: int) -> None:
    """Every response is a complete answer or a 503 with Retry-After, nothing else."""
    for response in responses:
        if response.status_code == 503:
            error = assert_openai_error(response, 503)
            assert error["type"] == "service_unavailable"
            assert int(response.headers["retry-after"]) >= 1
        else:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == max_tokens


def test_queue_over_max_waiting_is_503_with_retry_after(limited_server):
    """One engine seat, one waiting place (--max-num-seqs 1 --max-waiting 1). A burst of eight
    at an idle server: one is admitted, and the others arrive within milliseconds, while it
    still waits or has just taken the seat, so at most one more fits; the rest get 503 +
    Retry-After at once. Then, with the seat held by a long request, a second burst: exactly
    one takes the waiting place. Every admitted request runs to completion."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {**COMPLETION, "max_tokens": 16, "ignore_eos": True}

    async def bursts() -> tuple[list[httpx.Response], httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=limited_server.url, headers=headers,
                                     timeout=120) as client:  # fmt: skip

            async def burst() -> list[httpx.Response]:
                return await simultaneous_posts(
                    limited_server.port, "/v1/completions", body, headers, 8
                )

            at_idle = await burst()
            holder = asyncio.create_task(
                client.post("/v1/completions", json={**body, "max_tokens": 96})
            )
            while True:  # until the holder runs (and so waits no more)
                metrics = parse_metrics((await client.get("/metrics")).text)
                if metrics["tandem:num_requests_running"] == 1:
                    break
                assert not holder.done(), holder.result().text
                await asyncio.sleep(0.02)
            while_held = await burst()
            return at_idle, await holder, while_held

    at_idle, holder, while_held = asyncio.run(bursts())
    statuses = sorted(response.status_code for response in at_idle)
    assert 1 <= statuses.count(200) <= 2 and set(statuses) <= {200, 503}, statuses
    _check_admitted_or_refused(at_idle, 16)
    assert holder.status_code == 200 and holder.json()["usage"]["completion_tokens"] == 96
    statuses = sorted(response.status_code for response in while_held)
    assert statuses == [200] + [503] * 7, statuses
    _check_admitted_or_refused(while_held, 16)
    wait_until_idle(limited_server.url)
    response = httpx.post(f"{limited_server.url}/v1/completions", json=body, headers=headers,
                          timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text


# -- priority ------------------------------------------------------------------------------


def test_priority_needs_priority_scheduling(http):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        error = assert_openai_error(http.post(path, json={**body, "priority": 1}), 400, "priority")
        assert "--scheduling-policy priority" in error["message"], error
        assert http.post(path, json={**body, "priority": 0}).status_code == 200


def test_priority_orders_the_queue(server_factory):
    """One seat, held by a long request; a request with priority 5 arrives, then one with -1:
    the -1 runs first when the seat frees (lower first, as vLLM), and both complete."""
    server = server_factory.start(
        "--scheduling-policy", "priority", "--max-num-seqs", "1", name="priority-server"
    )
    body = {**COMPLETION, "max_tokens": 8, "ignore_eos": True}

    async def run() -> list[str]:
        finished: list[str] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:

            async def send(name: str, priority: int, max_tokens: int) -> None:
                payload = {**body, "priority": priority, "max_tokens": max_tokens}
                response = await client.post("/v1/completions", json=payload)
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == max_tokens
                finished.append(name)

            holder = asyncio.create_task(send("holder", 0, 64))
            while True:  # until the holder has the seat
                metrics = parse_metrics((await client.get("/metrics")).text)
                if metrics["tandem:num_requests_running"] == 1:
                    break
                await asyncio.sleep(0.02)
            late = asyncio.create_task(send("priority 5", 5, 8))
            while (
                parse_metrics((await client.get("/metrics")).text)["tandem:num_requests_waiting"]
                < 1
            ):
                await asyncio.sleep(0.02)
            urgent = asyncio.create_task(send("priority -1", -1, 8))
            await asyncio.gather(holder, late, urgent)
        return finished

    order = asyncio.run(run())
    assert order.index("priority -1") < order.index("priority 5"), order
