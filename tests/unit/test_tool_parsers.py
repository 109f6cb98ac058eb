"""Tool calls read out of replies (server/tool_parsers.py): each format, what stays content, and
a stream that gives the same content and calls as the whole reply, however it is cut."""

from __future__ import annotations

import json
import random
import re

import pytest

from tandem.server.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    FunctionCall,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    required_calls_schema,
    tool_parser,
)

PARIS = FunctionCall("get_weather", '{"city": "Paris"}')
NOW = FunctionCall("now", "{}")


def call(name: str, **arguments: object) -> FunctionCall:
    return FunctionCall(name, json.dumps(arguments, ensure_ascii=False))


def content(name: str, reply: str) -> tuple[str, str, str, list[FunctionCall]]:
    """A reply that is not read as calls: all of it is content."""
    return name, reply, reply, []


# (parser, reply, content, calls)
CASES = [
    # hermes
    content("hermes", "It is sunny."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
     '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>',
     "Let me look.\n", [PARIS, NOW]),
    # the last block left open (the reply ended at a stop token or max_tokens)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     None, [PARIS]),
    # arguments written as a JSON string, and non-ASCII kept as is
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"café\\"}"}</tool_call>',
     None, [call("f", q="café")]),
    # one block that is not a call: the whole reply is content, tags and all
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
     "<tool_call>{not json}</tool_call>",
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
     "<tool_call>{not json}</tool_call>", []),
    content("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    content("hermes", "a < b, and <tool>"),
    # llama3_json
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; '
     '{"name": "now", "parameters": {}}', None, [PARIS, NOW]),
    ("llama3_json", '  \n{"name": "now", "parameters": {}}\n', None, [NOW]),
    content("llama3_json", 'Sure: {"name": "now", "parameters": {}}'),
    content("llama3_json", '{"name": "now", "parameters": {}} and more'),
    content("llama3_json", '{"city": "Paris"}'),
    ("llama4_json", '{"name": "now", "parameters": {}}', None, [NOW]),
    # pythonic
    ("pythonic", '[get_weather(city="Paris"), now()]', None, [PARIS, NOW]),
    ("pythonic", '[f(a=1, b=[1.5, None, True], c={"k": "v"})]', None,
     [call("f", a=1, b=[1.5, None, True], c={"k": "v"})]),
    content("pythonic", '[f("positional")]'),
    content("pythonic", "[f(a=g())]"),
    content("pythonic", "[1, 2]"),
    content("pythonic", "[f(a=1)] then text"),
    content("pythonic", "No calls [f(a=1)]"),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "now", "arguments": {}}]', None, [PARIS, NOW]),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}',
     "Checking. ", [PARIS, NOW]),
    ("mistral", "[TOOL_CALLS][{broken", "[{broken", []),
    content("mistral", "Just text"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_each_format_gives_its_content_and_calls(name, reply, content, calls) -> None:
    assert tool_parser(name).extract(reply) == ExtractedToolCalls(content, calls)


def _streamed(name: str, pieces: list[str]) -> tuple[str, list[FunctionCall], list[str]]:
    stream = ToolCallStream(tool_parser(name))
    sent = [stream.feed(piece) for piece in pieces]
    rest, calls = stream.finish()
    return "".join(sent) + rest, calls, sent


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_a_stream_cut_anywhere_gives_the_whole_replys_content_and_calls(
    name, reply, content, calls
) -> None:
    cuts = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)]
    cuts.append(list(reply))  # a character at a time
    rng = random.Random(len(reply))
    for _ in range(5):
        points = sorted(rng.sample(range(len(reply) + 1), k=min(4, len(reply) + 1)))
        cuts.append([reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)])
    for pieces in cuts:
        streamed_content, streamed_calls, _ = _streamed(name, pieces)
        assert streamed_content == (content or "")
        assert streamed_calls == calls


def test_text_before_a_call_streams_as_it_comes_and_the_call_waits() -> None:
    _, _, sent = _streamed("hermes", ["Let me ", "look. <tool", '_call>{"name": "now"', "}"])
    assert sent == ["Let me ", "look. ", "", ""]  # "<tool" could begin a call: held back
    _, _, sent = _streamed("hermes", ["a <", "b> c"])
    assert sent == ["a ", "<b> c"]  # "<" could; "<b" could not
    _, _, sent = _streamed("llama3_json", ["  ", "Hello", " there"])
    assert sent == ["", "  Hello", " there"]
    _, _, sent = _streamed("pythonic", ["[f(", "a=1)]"])
    assert sent == ["", ""]


def test_ids_are_openai_style_or_mistrals_nine_characters() -> None:
    ids = {tool_parser("hermes").call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", tool_parser("mistral").call_id()) for _ in range(20))


def test_parsers_that_read_special_tokens_keep_them() -> None:
    kept = {name for name, parser in TOOL_PARSERS.items() if parser.keeps_special_tokens}
    assert kept == {"hermes", "mistral"}


def test_an_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, llama4_json, mistral, pythonic"):
        tool_parser("nope")


def test_forced_calls_are_read_from_the_held_reply() -> None:
    """tool_choice "required": a JSON list of {name, parameters}; named: the reply is the
    arguments. What is not such a list (cut by max_tokens) stays content."""
    required = RequiredToolParser()
    reply = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
        '{"name": "now", "parameters": {}}]'
    )
    assert required.extract(reply) == ExtractedToolCalls(None, [PARIS, NOW])
    for cut in ('[{"name": "get_weather", "parameters": {"ci', "[]", "{}"):
        assert required.extract(cut) == ExtractedToolCalls(cut, [])
    named = NamedToolParser("get_weather")
    assert named.extract('{"city": "Paris"}') == ExtractedToolCalls(None, [PARIS])
    assert named.extract('{"ci') == ExtractedToolCalls(None, [FunctionCall("get_weather", '{"ci')])
    assert required.forced and named.forced and not tool_parser("hermes").forced


def test_the_required_schema_lists_calls_of_any_tool_with_their_defs_on_top() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    functions = [
        {"name": "move", "parameters": {"type": "object", "$defs": {"Point": point},
                                        "properties": {"to": {"$ref": "#/$defs/Point"}}}},
        {"name": "stop"},
    ]  # fmt: skip
    schema = required_calls_schema(functions, one_call=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert schema["$defs"] == {"Point": point}
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["move"]}
    assert "$defs" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert required_calls_schema(functions, one_call=True)["maxItems"] == 1
    clash = {"name": "jump", "parameters": {"$defs": {"Point": {"type": "string"}}}}
    with pytest.raises(ValueError, match="define \\$defs/Point differently"):
        required_calls_schema([*functions, clash], one_call=False)
