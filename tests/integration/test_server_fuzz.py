"""Bad bodies, generated: whatever a client sends, the server answers 2xx or an OpenAI-shaped 4xx,
never a 5xx, and keeps serving the same answers afterwards."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

from server_process import ServerProcess, assert_error_shape, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600, func_only=True)]

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Hi"}]
# (endpoint, the fields its request models know, a valid body to mutate)
ENDPOINTS = [
    (
        "/v1/completions",
        sorted(CompletionRequest.model_fields),
        {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
    ),
    (
        "/v1/chat/completions",
        sorted(ChatCompletionRequest.model_fields),
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    ),
    ("/tokenize", sorted(TokenizeCompletionRequest.model_fields), {"prompt": "Hello"}),
    ("/tokenize", sorted(TokenizeChatRequest.model_fields), {"messages": MESSAGES}),
    ("/detokenize", sorted(DetokenizeRequest.model_fields), {"tokens": [1, 2, 3]}),
]
CONTENT_TYPES = [
    "application/json", "application/json; charset=utf-8", None, "text/plain",
    "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz",
    "application/octet-stream",
]  # fmt: skip
# Values that reach deeper than random ones: near-valid shapes of the fields' types.
MESSAGE_SHAPES = [
    MESSAGES, [{"role": "assistant", "content": None}], [{"role": "system", "content": "s"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    [{"role": "tool", "content": "t", "tool_call_id": "1"}],
    [{"role": "developer", "content": [{"type": "text", "text": "d"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
    [{"role": "user", "content": "\ud800"}], [{"role": "user"}], [{"content": "x"}],
    [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"arguments": "[1"}}]}],
]  # fmt: skip
# tools and tool_choice
TOOL_SHAPES = [
    [{"type": "function", "function": {"name": "f"}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    [{"function": {"name": ""}}], {"type": "function", "function": {"name": "f"}},
    {"function": {"name": "g"}}, "auto", "required",
]  # fmt: skip
NEAR_VALID = [
    0, 1, 2, -1, 4, 20, 21, 0.0, 0.5, 1.0, 1.5, -0.5, 2**63, -(2**63), 2**64, 1e308, -1e308,
    math.inf, -math.inf, math.nan, True, False, None, "", "default", "text", "user", "none",
    "Hello", "\x00", "\ud800", "a\udfffb", "{{ messages }}", "{%",
    [], [1, 2], [0], [-1], [2**40], [""], ["x"], [[1], [2]], [[]], *MESSAGE_SHAPES, *TOOL_SHAPES,
    {}, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
    {"type": "text"}, {"tokenize": True}, {"add_generation_prompt": False}, {"x": [1, {}]},
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 40),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.one_of(
    st.sampled_from(NEAR_VALID),
    st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                    max_size=4),
        max_leaves=8,
    ),
)  # fmt: skip


# The chat template is rendered in the API process from what the request says: templates and
# apply_chat_template keywords, harmless (no huge loops or strings) but often broken.
TEMPLATES = [
    "", "plain", "{{", "{%", "}}", "{% if %}", "{{ undefined_thing.attr }}", "{{ 1 / 0 }}",
    "{{ raise_exception('no') }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{{ messages[5].content }}", "{{ bos_token }}{{ messages | tojson }}",
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}\n{% endfor %}",
]  # fmt: skip
TEMPLATE_KEYWORDS = [
    "tokenize", "add_generation_prompt", "continue_final_message", "return_dict", "tools",
    "documents", "conversation", "chat_template", "padding", "truncation", "max_length",
    "return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask", "custom_variable",
]  # fmt: skip


@st.composite
def template_bodies(draw) -> tuple[str, bytes, str | None]:
    path = draw(st.sampled_from(["/v1/chat/completions", "/tokenize"]))
    body: dict = {"messages": MESSAGES, "max_tokens": 2}
    if path == "/tokenize":
        del body["max_tokens"]
    if draw(st.booleans()):
        body["chat_template"] = draw(st.sampled_from(TEMPLATES) | st.text(max_size=12))
    if draw(st.booleans()):
        kwargs = st.dictionaries(st.sampled_from(TEMPLATE_KEYWORDS), scalars, max_size=3)
        body["chat_template_kwargs"] = draw(kwargs)
    if draw(st.booleans()):
        body["messages"] = draw(st.sampled_from(MESSAGE_SHAPES) | values)
    if draw(st.booleans()):
        key = draw(st.sampled_from(["add_generation_prompt", "continue_final_message"]))
        body[key] = draw(st.booleans() | values)
    if draw(st.booleans()):  # tools the template renders ("none": nothing parses the reply)
        body["tools"] = draw(st.sampled_from(TOOL_SHAPES) | values)
        if path != "/tokenize":
            body["tool_choice"] = "none"
    return path, json.dumps(body).encode(), "application/json"


def _small(value, limit: int):
    """A valid count stays valid but small, so a valid body runs in a moment."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return min(value, limit)
    return value


def _cap_work(path: str, body: dict) -> dict:
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body:
            body[key] = _small(body[key], 4)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4  # absent or null: 16 for completions, the context for chat
    for key, limit in (("n", 4), ("best_of", 4), ("min_tokens", 4)):
        if key in body:
            body[key] = _small(body[key], limit)
    return body


@st.composite
def json_bodies(draw) -> tuple[str, bytes, str | None]:
    path, fields, valid = draw(st.sampled_from(ENDPOINTS))
    body = dict(valid) if draw(st.booleans()) or draw(st.booleans()) else {}
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=2)) if body else ():
        body.pop(key, None)  # a required field missing
    names = st.one_of(st.sampled_from(fields), st.sampled_from(fields), st.text(max_size=10))
    body.update(draw(st.dictionaries(names, values, max_size=4)))
    if path in ("/v1/completions", "/v1/chat/completions"):
        body = _cap_work(path, body)
    # Python's json writes NaN and Infinity, which its parser (and so the server's) accepts.
    raw = json.dumps(body).encode()
    content_type = draw(st.sampled_from(CONTENT_TYPES[:3])) if draw(st.booleans()) else (
        draw(st.sampled_from(CONTENT_TYPES)))  # fmt: skip
    return path, raw, content_type


@st.composite
def odd_bodies(draw) -> tuple[str, bytes, str | None]:
    path, _, body = draw(st.sampled_from(ENDPOINTS))
    valid = json.dumps(body).encode()
    raw = draw(
        st.one_of(
            st.just(b""),
            st.binary(max_size=64),
            st.text(max_size=32).map(str.encode),
            st.sampled_from([b"null", b"[]", b"{}", b"0", b'"x"', b"[{}]", b"{", b"\xff\xfe{}",
                             b'{"prompt": "a", "prompt": 1}', b"NaN", b"1e999"]),
            st.integers(1, len(valid) - 1).map(lambda cut: valid[:cut]),  # truncated JSON
            values.map(lambda value: json.dumps(value).encode()),  # JSON that is no object
        )
    )  # fmt: skip
    return path, raw, draw(st.sampled_from(CONTENT_TYPES))


def _check_response(response: httpx.Response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:2000]}"
    if status >= 400:
        assert_error_shape(response.json())
        return
    assert status == 200, status
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n") if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            assert line.startswith("data: "), line
            event_body = json.loads(line[len("data: ") :])
            if "error" in event_body:  # a request that failed after the stream started
                assert_error_shape(event_body)
    else:
        assert isinstance(response.json(), dict)


def _greedy(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of "
                         "France is", "max_tokens": 16, "temperature": 0})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_generated_bad_bodies_never_get_a_5xx(default_server: ServerProcess):
    with httpx.Client(base_url=default_server.url, timeout=120) as http:
        before = _greedy(http)

        @settings(
            max_examples=150, deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )  # fmt: skip
        @given(case=st.one_of(json_bodies(), json_bodies(), odd_bodies(), template_bodies()))
        def check(case: tuple[str, bytes, str | None]) -> None:
            path, raw, content_type = case
            headers = {} if content_type is None else {"content-type": content_type}
            response = http.post(path, content=raw, headers=headers)
            event(f"{path} {response.status_code}")
            _check_response(response)

        check()
        assert http.get("/health").status_code == 200
        wait_until_idle(default_server.url)
        assert _greedy(http) == before
