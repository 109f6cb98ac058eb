"""Tool calling and reasoning as agents use them: the `openai` client against `tandem serve
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, the embedded
model shown three calls (or three thought-out answers) in its history, so that it writes a
fourth, a Hermes-style chat template sent with the request."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest

from tandem.server.reasoning_parsers import reasoning_parser

from server_process import ServerProcess, joined_reply, whole_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

# The tools and each call in the history as Hermes's templates write them (ChatML).
TEMPLATE = """
{%- if tools %}<|im_start|>system
You can call these functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}To call one, write <tool_call>, a JSON object with "name" and "arguments", then \
</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def asked(city: str) -> dict:
    return {"role": "user", "content": f"What is the weather in {city}?"}


def called(city: str, index: int) -> dict:
    function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
    call = {"id": f"call_{index}", "type": "function", "function": function}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# Three questions, each answered by a call: greedy, the model answers the fourth so too.
FEW_SHOT = [
    m for i, city in enumerate(["Paris", "Rome", "Berlin"]) for m in (asked(city), called(city, i))
]
OSLO = [*FEW_SHOT, asked("Oslo")]
REQUEST = {"model": "default", "temperature": 0, "max_tokens": 40,
           "extra_body": {"chat_template": TEMPLATE}}  # fmt: skip


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--exclude-tools-when-tool-choice-none", "--reasoning-parser", "qwen3",
        "--trust-request-chat-template",
        log_dir=tmp_path_factory.mktemp("tools-server"), name="tools-server",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(tools_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.base_url, api_key="x", max_retries=0, timeout=120)


def test_the_reply_is_a_call_with_its_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(messages=OSLO, tools=TOOLS, **REQUEST)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_a_streamed_reply_gives_the_same_call(client: openai.OpenAI) -> None:
    whole = whole_reply(client.chat.completions.create(messages=OSLO, tools=TOOLS, **REQUEST))
    stream = client.chat.completions.create(messages=OSLO, tools=TOOLS, stream=True, **REQUEST)
    assert joined_reply(stream) == whole
    assert whole["content"] is None and whole["finish"] == "tool_calls" and whole["calls"]


def test_the_tools_answer_goes_back_through_the_template(client: openai.OpenAI) -> None:
    """The call's result as a tool message, the call itself in the history: the template gets
    the arguments as an object (tojson writes them), and the model answers in text."""
    first = client.chat.completions.create(messages=OSLO, tools=TOOLS, **REQUEST)
    message = first.choices[0].message
    history = [*OSLO, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                "content": "Snow, -3 degrees."}]  # fmt: skip
    reply = client.chat.completions.create(messages=history, tools=TOOLS, **REQUEST)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tool_choice_none_leaves_the_reply_as_text(client: openai.OpenAI) -> None:
    """This server excludes the tools from the template for "none"
    (--exclude-tools-when-tool-choice-none): the prompt is the one without tools."""
    none = client.chat.completions.create(messages=OSLO, tools=TOOLS, tool_choice="none", **REQUEST)
    plain = client.chat.completions.create(messages=OSLO, **REQUEST)
    auto = client.chat.completions.create(messages=OSLO, tools=TOOLS, **REQUEST)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens
    message = none.choices[0].message
    assert message.tool_calls == [] and "<tool_call>" in message.content
    assert none.choices[0].finish_reason != "tool_calls"


def test_the_default_server_renders_tools_and_refuses_auto(default_server: ServerProcess) -> None:
    """Without --enable-auto-tool-choice: tools with tool_choice "none" are rendered, not read;
    tools without a tool_choice mean "auto", which it cannot honour (vLLM's rule and words);
    a named function it can."""
    client = openai.OpenAI(base_url=default_server.base_url, api_key="x", max_retries=0)
    none = client.chat.completions.create(messages=OSLO, tools=TOOLS, tool_choice="none", **REQUEST)
    plain = client.chat.completions.create(messages=OSLO, **REQUEST)
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert none.choices[0].message.tool_calls == []
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as error:
        client.chat.completions.create(messages=OSLO, tools=TOOLS, **REQUEST)
    assert error.value.body["param"] == "tool_choice"
    # a named function needs no parser: the reply is held to its parameters
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(messages=OSLO, tools=TOOLS, tool_choice=named, **REQUEST)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


# Three answers, each thought out first: the model thinks before the fourth too.
THOUGHT_OUT = [
    message
    for question, thought, answer in [
        ("What is 2 + 2?", "Two plus two makes four.", "4"),
        ("What is 3 + 5?", "Three plus five makes eight.", "8"),
        ("What is 6 + 1?", "Six plus one makes seven.", "7"),
    ]
    for message in (
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"<think>{thought}</think>{answer}"},
    )
] + [{"role": "user", "content": "What is 4 + 4?"}]


def test_the_thinking_is_split_from_the_answer(
    client: openai.OpenAI, default_server: ServerProcess
) -> None:
    """The same greedy reply as the default server's (no parser), split at its think block;
    streamed, the same split; with include_reasoning false, the answer alone."""
    raw = openai.OpenAI(base_url=default_server.base_url, api_key="x", max_retries=0)
    text = raw.chat.completions.create(messages=THOUGHT_OUT, **REQUEST).choices[0].message.content
    assert "</think>" in text
    reasoning, content = reasoning_parser("qwen3").split(text)
    message = client.chat.completions.create(messages=THOUGHT_OUT, **REQUEST).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (
        reasoning, reasoning, content
    )  # fmt: skip
    streamed = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(messages=THOUGHT_OUT, stream=True, **REQUEST):
        delta = chunk.choices[0].delta
        streamed["reasoning"] += getattr(delta, "reasoning", None) or ""
        streamed["content"] += delta.content or ""
    assert streamed == {"reasoning": reasoning, "content": content}
    extra = {**REQUEST["extra_body"], "include_reasoning": False}
    reply = client.chat.completions.create(messages=THOUGHT_OUT, **{**REQUEST, "extra_body": extra})
    assert (reply.choices[0].message.reasoning, reply.choices[0].message.content) == (
        None, content
    )  # fmt: skip


def test_auto_tool_choice_needs_a_parser_before_the_model_loads() -> None:
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tandem.cli", "serve", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    result = serve("--enable-auto-tool-choice")
    assert result.returncode == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in result.stderr
    result = serve("--enable-auto-tool-choice", "--tool-call-parser", "nope")
    assert result.returncode == 2 and "hermes" in result.stderr  # the choices are listed
