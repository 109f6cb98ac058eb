"""Stream chunks written from a template (serving.TextChunk) are the bytes pydantic writes for
the same chunk, and the shapers use the template only for chunks that carry nothing but text."""

from __future__ import annotations

import json

import pytest

from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.protocol_responses import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from tandem.server.reasoning_parsers import reasoning_parser
from tandem.server.serving import (
    ChatShaper,
    CompletionShaper,
    PromptJob,
    TextChunk,
    TokenText,
    chat_logprobs,
    completion_logprobs,
)
from tandem.server.tool_parsers import tool_parser

TEXTS = [
    "",
    " hello",
    'quote " and backslash \\ and slash /',
    "".join(chr(code) for code in range(32)) + "\x7f",  # every control character, and DEL
    "naïve café — ünïcödé, 日本語, emoji 🤖🎉, line separator \u2028 and \u2029",
    "\ufffd replacement character",
    "tab\tnewline\nreturn\r",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("index", [0, 7])
def test_text_chunk_is_pydantics_json(text: str, index: int) -> None:
    response_id, model = 'cmpl-"odd" id ü', "models/smöl \\ lm"
    completion = TextChunk(response_id, "text_completion", model, '"text":')(index, text)
    expected = CompletionStreamResponse(
        id=response_id,
        model=model,
        created=json.loads(completion)["created"],
        choices=[CompletionResponseStreamChoice(index=index, text=text)],
    ).model_dump_json(exclude_none=True)
    assert completion == expected
    chat = TextChunk(response_id, "chat.completion.chunk", model, '"delta":{"content":')
    chat_chunk = chat(index, text)
    expected = ChatCompletionStreamResponse(
        id=response_id,
        model=model,
        created=json.loads(chat_chunk)["created"],
        choices=[ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=text))],
    ).model_dump_json(exclude_none=True)
    assert chat_chunk == expected


def _output(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", "p", [1, 2, 3], list(completions), finished, RequestMetrics(0.0))


def _job(n: int = 1) -> PromptJob:
    return PromptJob("p", [1, 2, 3], SamplingParams(n=n, max_tokens=8))


def _completions(**fields: object) -> CompletionShaper:
    request = CompletionRequest(model="m", prompt="p", stream=True, **fields)
    return CompletionShaper(request, [_job(fields.get("n", 1))], "m", TokenText())


def _chat(
    messages: list[dict] | None = None, response_role: str = "assistant", **fields: object
) -> ChatShaper:
    request = ChatCompletionRequest(
        model="m", messages=messages or [{"role": "user", "content": "p"}], stream=True, **fields
    )
    return ChatShaper(request, _job(fields.get("n", 1)), "m", TokenText(), response_role)


# -- tool calls read out of chat replies ------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
TWO_CALLS = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
)


def _tool_chat(thinking: str | None = None, tools: bool = True, **fields: object) -> ChatShaper:
    """A streamed chat whose replies' calls the hermes parser reads (with `thinking`, split off
    by that reasoning parser first; without `tools`, only that)."""
    request = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "p"}], stream=True,
        tools=TOOLS if tools else None, **fields,
    )  # fmt: skip
    return ChatShaper(
        request, _job(fields.get("n", 1)), "m", TokenText(),
        tool_parser=tool_parser("hermes") if tools else None,
        reasoning_parser=None if thinking is None else reasoning_parser(thinking),
    )  # fmt: skip


def _pieces(text: str, size: int, index: int = 0) -> list[CompletionOutput]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        CompletionOutput(index, piece, [5], finish_reason="stop" if last else None)
        for last, piece in zip([False] * (len(pieces) - 1) + [True], pieces, strict=True)
    ]


def _streamed_message(shaper: ChatShaper, outputs: list[CompletionOutput]) -> dict:
    """What a client that joins the deltas has: content, reasoning, calls by index, finish
    reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for output in outputs:
        chunk = shaper.chunk(0, _output(output, finished=output.finish_reason is not None))
        if chunk is None:
            continue
        assert isinstance(chunk, ChatCompletionStreamResponse)  # never the text template
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        reasoning += choice.delta.reasoning or ""
        assert choice.delta.reasoning_content == choice.delta.reasoning
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}  # fmt: skip


def _whole_message(shaper: ChatShaper, text: str) -> dict:
    done = _output(CompletionOutput(0, text, [5], finish_reason="stop"), finished=True)
    choice = shaper.response(done).choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls
    ]
    message = choice.message
    assert message.reasoning_content == message.reasoning
    return {"content": message.content, "reasoning": message.reasoning, "calls": calls,
            "finish": choice.finish_reason}  # fmt: skip


def _without_ids(message: dict) -> dict:
    return {**message, "calls": [{**c, "id": None} for c in message["calls"]]}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("text", [TWO_CALLS, "No calls here.", "<tool_call>{broken</tool_call>"])
def test_streamed_tool_calls_equal_the_whole_replys(text: str, size: int) -> None:
    streamed = _streamed_message(_tool_chat(), _pieces(text, size))
    whole = _whole_message(_tool_chat(), text)
    assert _without_ids(streamed) == _without_ids(whole)
    if text == TWO_CALLS:
        assert whole["content"] == "Checking."
        assert [json.loads(c["arguments"]) for c in whole["calls"]] == [
            {"city": "Paris"}, {"city": "Rome"}
        ]  # fmt: skip
        assert whole["finish"] == "tool_calls"
        assert all(c["id"].startswith("chatcmpl-tool-") for c in streamed["calls"] + whole["calls"])
    else:
        assert (whole["content"], whole["calls"], whole["finish"]) == (text, [], "stop")


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    whole = _whole_message(_tool_chat(parallel_tool_calls=False), TWO_CALLS)
    streamed = _streamed_message(_tool_chat(parallel_tool_calls=False), _pieces(TWO_CALLS, 5))
    for message in whole, streamed:
        assert [json.loads(c["arguments"]) for c in message["calls"]] == [{"city": "Paris"}]


def test_each_choice_is_read_on_its_own() -> None:
    shaper = _tool_chat(n=2)
    first = shaper.chunk(
        0, _output(CompletionOutput(0, "<tool_", [5]), CompletionOutput(1, "Hi", [6]))
    )
    assert [(c.index, c.delta.content) for c in first.choices] == [(1, "Hi")]  # 0 held back
    last = shaper.chunk(
        0,
        _output(
            CompletionOutput(
                0, 'call>{"name": "get_weather", "arguments": {}}', [7], finish_reason="stop"
            ),
            CompletionOutput(1, " there", [8], finish_reason="stop"),
            finished=True,
        ),
    )
    by_index = {c.index: c for c in last.choices}
    assert by_index[0].finish_reason == "tool_calls"
    assert by_index[0].delta.tool_calls[0].function.name == "get_weather"
    assert (by_index[1].delta.content, by_index[1].finish_reason) == (" there", "stop")


def test_held_back_text_still_sends_its_logprobs_and_token_ids() -> None:
    shaper = _tool_chat(logprobs=True)
    row = {5: Logprob(-0.5, 1, "<tool_")}
    chunk = shaper.chunk(0, _output(CompletionOutput(0, "<tool_", [5], logprobs=[row])))
    (choice,) = chunk.choices
    assert choice.delta.content is None and choice.logprobs.content[0].token == "<tool_"
    chunk = _tool_chat(return_token_ids=True).chunk(0, _output(CompletionOutput(0, "<tool_", [5])))
    assert chunk.choices[0].token_ids == [5] and chunk.choices[0].delta.content is None
    assert _tool_chat().chunk(0, _output(CompletionOutput(0, "<tool_", [5]))) is None


def test_plain_deltas_take_the_template_and_the_rest_the_model() -> None:
    shaper = _completions()
    plain = shaper.chunk(0, _output(CompletionOutput(0, " a", [5])))
    assert isinstance(plain, str)
    assert json.loads(plain)["choices"] == [{"index": 0, "text": " a"}]
    finishing = CompletionOutput(0, " b", [6], finish_reason="length")
    last = shaper.chunk(0, _output(finishing, finished=True))
    assert isinstance(last, CompletionStreamResponse)
    assert last.choices[0].finish_reason == "length"
    assert shaper.usage.completion_tokens == 2  # counted on both paths

    chat = _chat()
    assert isinstance(chat.chunk(0, _output(CompletionOutput(0, " a", [5]))), str)
    stopped = chat.chunk(
        0, _output(CompletionOutput(0, "", [2], finish_reason="stop", stop_reason=2))
    )
    assert isinstance(stopped, ChatCompletionStreamResponse)
    assert stopped.choices[0].stop_reason == 2


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": 1},
        {"return_token_ids": True},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"echo": True, "logprobs": 0},
    ],
)
def test_completion_chunks_with_more_than_text_use_the_model(fields: dict) -> None:
    shaper = _completions(**fields)
    row = {5: Logprob(-0.5, 1, " a")}
    chunk = shaper.chunk(0, _output(CompletionOutput(0, " a", [5], logprobs=[row])))
    assert isinstance(chunk, CompletionStreamResponse)


def test_an_echoed_prompt_is_text_too() -> None:
    shaper = _completions(echo=True)
    chunk = shaper.chunk(0, _output(CompletionOutput(0, " a", [5])))
    assert json.loads(chunk)["choices"] == [{"index": 0, "text": "p a"}]


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": True, "top_logprobs": 1},
        {"return_token_ids": True},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ],
)
def test_chat_chunks_with_more_than_text_use_the_model(fields: dict) -> None:
    shaper = _chat(**fields)
    row = {5: Logprob(-0.5, 1, " a")}
    chunk = shaper.chunk(0, _output(CompletionOutput(0, " a", [5], logprobs=[row])))
    assert isinstance(chunk, ChatCompletionStreamResponse)


def test_two_choices_in_one_delta_use_the_model() -> None:
    shaper = _completions(n=2)
    chunk = shaper.chunk(0, _output(CompletionOutput(0, " a", [5]), CompletionOutput(1, " b", [6])))
    assert isinstance(chunk, CompletionStreamResponse)
    assert [c.index for c in chunk.choices] == [0, 1]
    single = shaper.chunk(0, _output(CompletionOutput(0, "", []), CompletionOutput(1, " c", [7])))
    assert isinstance(single, str)
    assert json.loads(single)["choices"] == [{"index": 1, "text": " c"}]


CONTINUED = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon"},
]


def test_chat_echo_puts_the_continued_message_in_front_of_the_reply() -> None:
    """vLLM's chat echo: the last message's content comes first when that message has the
    reply's role; streamed, as a chunk per choice after the role's."""
    shaper = _chat(CONTINUED, echo=True, n=2, add_generation_prompt=False,
                   continue_final_message=True)  # fmt: skip
    opening, *echoes = shaper.opening_chunks()
    assert [c.delta.role for c in opening.choices] == ["assistant", "assistant"]
    assert [(e.choices[0].index, e.choices[0].delta.content) for e in echoes] == [
        (0, "Once upon"), (1, "Once upon")
    ]  # fmt: skip
    reply = _output(CompletionOutput(0, " a time", [5], finish_reason="length"), finished=True)
    message = shaper.response(reply).choices[0].message
    assert (message.role, message.content) == ("assistant", "Once upon a time")
    # a new assistant message: the last message is the user's, nothing to echo
    fresh = _chat(CONTINUED[:1], echo=True)
    assert len(fresh.opening_chunks()) == 1
    assert fresh.response(reply).choices[0].message.content == " a time"
    # without echo the continued message is not repeated
    plain = _chat(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert len(plain.opening_chunks()) == 1


def test_chat_reply_role_is_the_servers_or_the_continued_messages() -> None:
    assert _chat(response_role="bot").opening_chunks()[0].choices[0].delta.role == "bot"
    # with add_generation_prompt false the reply continues the last message, in its role
    shaper = _chat(add_generation_prompt=False, response_role="bot", echo=True)
    opening, echo = shaper.opening_chunks()
    assert opening.choices[0].delta.role == "user" and echo.choices[0].delta.content == "p"
    reply = _output(CompletionOutput(0, "!", [5], finish_reason="stop"), finished=True)
    assert shaper.response(reply).choices[0].message.role == "user"


def test_logprob_tokens_as_token_ids_and_the_first_prompt_tokens_text() -> None:
    rows = [None, {7: Logprob(-0.1, 1, "b"), 8: Logprob(-2.5, 2, "cc")}]
    named = completion_logprobs([6, 7], rows, 2, 10, TokenText(decode=lambda token: "A"))
    assert named.tokens == ["A", "b"]  # the first prompt token has no row: decoded
    assert named.text_offset == [10, 11]
    assert named.top_logprobs == [None, {"b": -0.1, "cc": -2.5}]
    by_id = completion_logprobs([6, 7], rows, 2, 0, TokenText(as_token_ids=True))
    assert by_id.tokens == ["token_id:6", "token_id:7"]
    assert by_id.top_logprobs[1] == {"token_id:7": -0.1, "token_id:8": -2.5}
    assert by_id.text_offset == [0, len("token_id:6")]  # offsets count the names, as vLLM's
    chat = chat_logprobs([7], rows[1:], 1, TokenText(as_token_ids=True)).content[0]
    assert (chat.token, chat.bytes) == ("token_id:7", list(b"token_id:7"))
    assert [top.token for top in chat.top_logprobs] == ["token_id:7"]


THOUGHT = "<think>The user wants Paris's weather.</think>"


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize(
    "text", [THOUGHT + TWO_CALLS, THOUGHT + "It is sunny.", "<think>cut off", "No thinking."]
)
@pytest.mark.parametrize("tools", [True, False])
def test_streamed_reasoning_equals_the_whole_replys(text: str, size: int, tools: bool) -> None:
    """The thinking split off first, the calls read from the answer; a stream gives what the
    whole reply gives."""
    streamed = _streamed_message(_tool_chat("qwen3", tools), _pieces(text, size))
    whole = _whole_message(_tool_chat("qwen3", tools), text)
    assert _without_ids(streamed) == _without_ids(whole)
    expected_reasoning = {THOUGHT + TWO_CALLS: "The user wants Paris's weather.",
                          THOUGHT + "It is sunny.": "The user wants Paris's weather.",
                          "<think>cut off": "cut off", "No thinking.": None}  # fmt: skip
    assert whole["reasoning"] == expected_reasoning[text]
    if text == THOUGHT + TWO_CALLS:
        assert len(whole["calls"]) == (2 if tools else 0)
        assert whole["content"] == ("Checking." if tools else TWO_CALLS)


def test_include_reasoning_false_leaves_the_thinking_out() -> None:
    text = THOUGHT + "It is sunny."
    whole = _whole_message(_tool_chat("deepseek_r1", include_reasoning=False), text)
    streamed = _streamed_message(
        _tool_chat("deepseek_r1", include_reasoning=False), _pieces(text, 3)
    )
    for message in whole, streamed:
        assert (message["reasoning"], message["content"]) == (None, "It is sunny.")
