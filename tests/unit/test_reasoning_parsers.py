"""Reasoning split from the answer (server/reasoning_parsers.py): where each parser's replies
start, what an unclosed block means, and a stream that splits as the whole reply does, however
it is cut."""

from __future__ import annotations

import pytest

from tandem.server.reasoning_parsers import ReasoningStream, reasoning_parser

# (parser, reply, reasoning, content)
CASES = [
    # DeepSeek-R1: the template opened the block; a <think> the reply repeats is dropped
    ("deepseek_r1", "I add them.</think>4", "I add them.", "4"),
    ("deepseek_r1", "<think>I add them.</think>\n\n4", "I add them.", "\n\n4"),
    ("deepseek_r1", "Cut off by max_tokens", "Cut off by max_tokens", None),
    ("deepseek_r1", "</think>4", None, "4"),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),  # one block: the rest is content
    ("deepseek_r1", "<b>bold</b></think>4", "<b>bold</b>", "4"),
    # Qwen3: the reply opens the block itself
    ("qwen3", "<think>I add them.</think>4", "I add them.", "4"),
    ("qwen3", "4", None, "4"),  # enable_thinking false: no block
    ("qwen3", "<think></think>4", None, "4"),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "x</think>y", None, "x</think>y"),
    ("qwen3", "a < b <thi", None, "a < b <thi"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "reply", "reasoning", "content"), CASES)
def test_each_parser_splits_the_whole_reply(name, reply, reasoning, content) -> None:
    assert reasoning_parser(name).split(reply) == (reasoning, content)


@pytest.mark.parametrize(("name", "reply", "reasoning", "content"), CASES)
def test_a_stream_cut_anywhere_splits_as_the_whole_reply(name, reply, reasoning, content) -> None:
    cuts = [[reply[:i], reply[i:]] for i in range(len(reply) + 1)] + [list(reply)]
    for pieces in cuts:
        stream = ReasoningStream(reasoning_parser(name))
        parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        streamed = "".join(r for r, _ in parts), "".join(c for _, c in parts)
        assert streamed == (reasoning or "", content or ""), pieces


def test_thinking_streams_as_it_comes() -> None:
    stream = ReasoningStream(reasoning_parser("qwen3"))
    assert stream.feed("<think>Let") == ("Let", "")
    assert stream.feed(" me see.</th") == (" me see.", "")  # "</th" may close the block
    assert stream.feed("ink>The answer") == ("", "The answer")
    assert stream.feed(" is 4.") == ("", " is 4.")


def test_an_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("nope")
