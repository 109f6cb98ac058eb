"""A reasoning model's thinking split from its answer (`--reasoning-parser`): the reply's
`reasoning` (vLLM's field, also sent as its older name `reasoning_content`) and its `content`.

Both parsers read `<think> ... </think>`. They differ in where a reply starts: DeepSeek-R1's
templates open the think block in the prompt, so its replies start in the reasoning (a
`<think>` at the start is dropped) and a reply that never closes it is all reasoning; Qwen3's
replies open it themselves, so a reply without `<think>` is all content (the template's
`enable_thinking: false` puts an empty block in the prompt). Once `</think>` closes the block
the rest is content, tags and all; the tags themselves are in neither part.

A stream splits each piece as it comes, holding back only a tail that could be the start of a
tag, so a streamed reply's reasoning and content are the whole reply's.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.server.tool_parsers import held_back


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # the template opened the think block (DeepSeek-R1)
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply as (reasoning, content), None for an empty part."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


REASONING_PARSERS = {
    parser.name: parser
    for parser in (
        ReasoningParser("deepseek_r1", starts_in_reasoning=True),
        ReasoningParser("qwen3", starts_in_reasoning=False),
    )
}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


class ReasoningStream:
    """One streamed choice's reply: `feed` each new piece and send the (reasoning, content) it
    returns; `finish` at the end gives what was held back."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        # "before": content, a <think> may open the block; "thinking"; "after": content only
        self.phase = "thinking" if parser.starts_in_reasoning else "before"
        self.opened = False  # in "thinking": whether its <think> was seen (or skipped)
        self.pending = ""  # text not split yet: a tail that may be the start of a tag

    def feed(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        reasoning, content = "", ""
        while self.pending:
            if self.phase == "after":
                content, self.pending = content + self.pending, ""
            elif self.phase == "before":
                text, found = self._until(self.parser.start)
                content += text
                if not found:
                    break
                self.phase, self.opened = "thinking", True
            else:
                if not self.opened:  # DeepSeek-R1: a <think> the reply repeats is dropped
                    start = self.parser.start
                    if start.startswith(self.pending) and len(self.pending) < len(start):
                        break  # could still be its <think>
                    self.opened = True
                    self.pending = self.pending.removeprefix(start)
                    continue
                text, found = self._until(self.parser.end)
                reasoning += text
                if not found:
                    break
                self.phase = "after"
        return reasoning, content

    def _until(self, tag: str) -> tuple[str, bool]:
        """The pending text before `tag`, and whether the tag followed (taken off with it);
        without the tag, a tail that could begin it stays pending."""
        cut = held_back(self.pending, tag)
        found = self.pending.startswith(tag, cut)
        text, self.pending = self.pending[:cut], self.pending[cut + len(tag) if found else cut :]
        return text, found

    def finish(self) -> tuple[str, str]:
        """What was held back, which no tag followed: in the think block it is reasoning."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.phase == "thinking" else ("", rest)
