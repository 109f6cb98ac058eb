"""Structured outputs through the server, as clients ask for them: OpenAI's response_format,
vLLM's guided_* and structured_outputs fields, and tool_choice "required" or naming a
function (the reply held to the calls' schema); the `openai` client against the shared
default server."""

from __future__ import annotations

import json

import openai
import pytest

from server_process import ServerProcess, joined_reply, whole_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
ASK_PERSON = [{"role": "user", "content": "Describe Ada Lovelace as a JSON object."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]  # fmt: skip
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"model": "default", "temperature": 0, "max_tokens": 80}


@pytest.fixture(scope="module")
def client(default_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.base_url, api_key="x", max_retries=0, timeout=120)


def test_response_format_json_schema_holds_the_reply(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = client.chat.completions.create(
        messages=ASK_PERSON, response_format=response_format, **GREEDY
    )
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        messages=ASK_PERSON, response_format=response_format, stream=True, **GREEDY
    )
    assert joined_reply(stream) == whole_reply(reply)
    ask = [{"role": "user", "content": "Give a JSON object with one key, 'color', and a value."}]
    anything = client.chat.completions.create(
        messages=ask, response_format={"type": "json_object"}, **GREEDY
    )
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def test_vllms_guided_fields_on_completions_and_chat(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        prompt="The color of the sky is", extra_body={"guided_choice": ["blue", "green"]}, **GREEDY
    )
    assert choice.choices[0].text in ("blue", "green")
    regex = client.chat.completions.create(
        messages=[{"role": "user", "content": "Write a year."}],
        extra_body={"structured_outputs": {"regex": "(19|20)[0-9]{2}"}}, **GREEDY,
    )  # fmt: skip
    content = regex.choices[0].message.content
    assert len(content) == 4 and content[:2] in ("19", "20") and content.isdigit()


def test_a_grammar_that_cannot_compile_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="parenthesis is not closed"):
        client.chat.completions.create(
            messages=ASK_PERSON, extra_body={"guided_regex": "(unclosed"}, **GREEDY
        )
    with pytest.raises(openai.BadRequestError, match="each ask for structured outputs") as error:
        client.chat.completions.create(
            messages=ASK_PERSON, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"}, **GREEDY,
        )  # fmt: skip
    assert error.value.body["param"] == "response_format"


def test_tool_choice_required_holds_the_reply_to_calls(client: openai.OpenAI) -> None:
    """A list of at least one call of the tools, read as calls; the finish reason stays the
    engine's (the model did not choose to call), streamed the same."""
    reply = client.chat.completions.create(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", **GREEDY
    )
    result = whole_reply(reply)
    assert result["content"] is None and result["finish"] == "stop" and result["calls"]
    for call in result["calls"]:
        arguments = json.loads(call["arguments"])
        key = {"get_weather": "city", "get_time": "zone"}[call["name"]]
        assert set(arguments) == {key} and isinstance(arguments[key], str)
    stream = client.chat.completions.create(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", stream=True, **GREEDY
    )
    assert joined_reply(stream) == result
    single = client.chat.completions.create(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        **GREEDY,
    )  # fmt: skip
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_named_tool_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        messages=ASK_WEATHER, tools=TOOLS, tool_choice=named, **GREEDY
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert set(json.loads(call.function.arguments)) == {"zone"}
    with pytest.raises(openai.BadRequestError, match="cannot also be held"):
        client.chat.completions.create(
            messages=ASK_WEATHER, tools=TOOLS, tool_choice=named,
            response_format={"type": "json_object"}, **GREEDY,
        )  # fmt: skip
