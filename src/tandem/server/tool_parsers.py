"""Tool calls read out of a chat reply's text (`tool_choice: "auto"`, `--tool-call-parser`).

Each parser knows one model family's way of writing calls and gives back the reply's content
(what the user should read) and its calls (a function name and its arguments as a JSON
string). What a parser cannot read as calls stays the reply's text, as in vLLM: a model that
writes a malformed call has said something, and the client sees it.

A stream sends the text before a call as it comes, then holds the rest back until the reply
ends and reads it as the whole reply is read (`ToolCallStream`): a streamed reply's content
and calls are exactly the non-streamed reply's, and each call arrives in one delta (clients
join a call's deltas; a partial JSON object is of no use to them before it closes).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # None: the reply is its calls alone
    calls: list[FunctionCall]


class ToolParser:
    """One way of writing calls. `content_end(text)`: how much of a reply so far is surely
    content, whatever follows (a stream sends that much); `extract(text)`: the whole reply."""

    name: str
    # Markers the tokenizer may hold as special tokens, which detokenizing would drop.
    keeps_special_tokens: bool = False
    # The reply was held to calls (tool_choice "required" or named): its finish reason stays
    # the engine's, as OpenAI's and vLLM's does.
    forced: bool = False

    def content_end(self, text: str) -> int:
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _as_call(value: Any) -> FunctionCall:
    """A call from `{"name": ..., "arguments" or "parameters": {...}}`; ValueError otherwise."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("a call is an object with a string `name`")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a call's arguments are an object")
    return FunctionCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """Where `text` stops being surely free of `marker`: its start, or the start of a tail
    that could be the marker's beginning."""
    found = text.find(marker)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)


class HermesToolParser(ToolParser):
    """Hermes, Qwen 2.5 / 3 and most ChatML models: `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`, one block a call; the last block may be left open. The content is the
    text before the first block; any block that is not a call makes the whole reply content."""

    name = "hermes"
    keeps_special_tokens = True
    START, END = "<tool_call>", "</tool_call>"

    def content_end(self, text: str) -> int:
        return held_back(text, self.START)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.START)
        if start < 0:
            return ExtractedToolCalls(text, [])
        calls = []
        try:
            for block in text[start:].split(self.START)[1:]:
                body = block.split(self.END, 1)[0]
                calls.append(_as_call(json.loads(body)))
        except ValueError:  # JSONDecodeError is one
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(text[:start] or None, calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-4 with JSON calls: the reply is `<|python_tag|>` (optional) and one JSON object
    `{"name": ..., "parameters" or "arguments": {...}}`, or several joined by `;`. Only a reply
    that starts so is read as calls (the content is then None); any other is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def content_end(self, text: str) -> int:
        start = text.lstrip()
        if not start or start.startswith(("{", self.TAG)) or self.TAG.startswith(start):
            return 0
        return len(text)

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        body = body.removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ExtractedToolCalls(text, [])
        decoder = json.JSONDecoder()
        calls, position = [], 0
        try:
            while True:
                value, position = decoder.raw_decode(body, position)
                calls.append(_as_call(value))
                rest = body[position:].lstrip()
                if not rest:
                    break
                if not rest.startswith(";"):
                    raise ValueError("calls are joined by ';'")
                position = len(body) - len(rest[1:].lstrip())
        except ValueError:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)


class Llama4JsonToolParser(Llama3JsonToolParser):
    name = "llama4_json"


class PythonicToolParser(ToolParser):
    """Llama 3.2 and others prompted for Python: the reply is a list of calls,
    `[get_weather(city="Paris"), now()]`, keyword arguments with literal values. Only a reply
    that is such a list alone is read as calls (the content is then None)."""

    name = "pythonic"

    def content_end(self, text: str) -> int:
        start = text.lstrip()
        return 0 if not start or start.startswith("[") else len(text)

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if not body.startswith("["):
            return ExtractedToolCalls(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                raise ValueError("not a list")
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError):
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)

    @staticmethod
    def _call(node: ast.expr) -> FunctionCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("each item is name(keyword=value, ...)")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise ValueError("no **kwargs")
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return FunctionCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`, or (v11
    tokenizers) `name{...}` for each call. The content is the text before the marker; calls that
    cannot be read leave the reply's text without the marker."""

    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    _ID_CHARACTERS = string.ascii_letters + string.digits

    def content_end(self, text: str) -> int:
        return held_back(text, self.MARKER)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.MARKER)
        if start < 0:
            return ExtractedToolCalls(text, [])
        content = text[:start]
        calls: list[FunctionCall] = []
        try:
            for part in text[start:].split(self.MARKER)[1:]:
                calls.extend(self._calls(part.strip()))
        except ValueError:
            return ExtractedToolCalls(text.replace(self.MARKER, ""), [])
        return ExtractedToolCalls(content or None, calls)

    @staticmethod
    def _calls(part: str) -> list[FunctionCall]:
        if part.startswith("["):
            values = json.loads(part)
            if not isinstance(values, list):
                raise ValueError("a list of calls")
            return [_as_call(value) for value in values]
        name, brace, arguments = part.partition("{")
        if not brace or not re.fullmatch(r"[A-Za-z_][\w.-]*", name.strip()):
            raise ValueError("name{arguments}")
        return [_as_call({"name": name.strip(), "arguments": json.loads(brace + arguments)})]

    def call_id(self) -> str:
        """Mistral's templates take 9 letters and digits."""
        return "".join(secrets.choice(self._ID_CHARACTERS) for _ in range(9))


class NamedToolParser(ToolParser):
    """tool_choice naming a function: the reply is its arguments, held to the function's
    parameters (structured outputs); one call, whatever the text (a reply cut by max_tokens
    keeps its partial arguments, as vLLM's)."""

    name = "named"
    forced = True

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def content_end(self, text: str) -> int:
        return 0

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(None, [FunctionCall(self.function_name, text)])


class RequiredToolParser(ToolParser):
    """tool_choice "required": the reply is a JSON list of `{"name": ..., "parameters":
    {...}}`, held to that shape over the tools (structured outputs; required_calls_schema);
    one that is not (cut by max_tokens) is content."""

    name = "required"
    forced = True

    def content_end(self, text: str) -> int:
        return 0

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            values = json.loads(text)
            if not isinstance(values, list) or not values:
                raise ValueError("a non-empty list of calls")
            calls = [_as_call(value) for value in values]
        except ValueError:
            return ExtractedToolCalls(text, [])
        return ExtractedToolCalls(None, calls)


def function_parameters(function: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function object's arguments schema; an empty object where it has none."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(functions: list[dict[str, Any]], one_call: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required"'s reply (vLLM's): a list of at least one call
    (at most one with parallel_tool_calls false) of any of the `functions` (OpenAI's function
    objects), each `{"name": <its name>, "parameters": <its arguments>}`. The functions'
    `$defs` move to the top, where their `#/$defs/...` references then point."""
    definitions: dict[str, Any] = {}
    choices = []
    for function in functions:
        parameters = dict(function_parameters(function))
        for name, definition in parameters.pop("$defs", {}).items():
            if definitions.setdefault(name, definition) != definition:
                raise ValueError(
                    f'two tools define $defs/{name} differently: tool_choice "required" needs '
                    "one schema for all of them; rename one"
                )
        choices.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
    if one_call:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        Llama4JsonToolParser,
        PythonicToolParser,
        MistralToolParser,
    )
}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


class ToolCallStream:
    """One streamed choice's reply: `feed` each new piece of text and send the content it
    returns; `finish` at the end gives the content still held back and the calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_sent = 0  # characters of the text sent as content

    def feed(self, piece: str) -> str:
        self.text += piece
        end = self.parser.content_end(self.text)
        if end <= self.num_sent:
            return ""
        content, self.num_sent = self.text[self.num_sent : end], end
        return content

    def finish(self) -> tuple[str, list[FunctionCall]]:
        """The parsers' content is always what they sent, then the rest (the text before the
        calls, all sent already; or the whole reply, or it less a marker, where no calls)."""
        extracted = self.parser.extract(self.text)
        return (extracted.content or "")[self.num_sent :], extracted.calls
