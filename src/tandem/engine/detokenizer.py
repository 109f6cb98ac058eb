"""Incremental detokenization and stop strings, one object per request.

Each step the engine appends a request's new token ids. Decoding the whole output again every
step would cost O(length) per token, so only a window is decoded: the tokens already turned into
text last time (context, so the decoder sees the new tokens mid-text) plus the tokens not yet
turned into text. Text is released only when it does not end in U+FFFD, i.e. once every byte of
a multi-byte character split over several tokens has arrived.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded as context before the first output token: SentencePiece decoders strip
# the leading space of a decode, so without them the first word would lose its space.
PROMPT_CONTEXT_TOKENS = 5
# What decoders emit for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


def _decoder(
    tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> Callable[[list[int]], str]:
    """`tokenizer.decode` with these settings. For a fast tokenizer that cleans up no spaces
    and decodes as every fast tokenizer does, this is its Rust decoder's own call:
    transformers' wrapper adds nothing then but ~4 µs of Python, twice per token, and the
    server decodes every stream's new token each step."""
    from transformers import PreTrainedTokenizerFast

    kind = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and kind.decode is PreTrainedTokenizerFast.decode
        and kind._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return functools.partial(
            tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens
        )
    return functools.partial(
        tokenizer.decode,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


class IncrementalDetokenizer:
    """The text of one request's output so far, cut at the first stop string.

    The text matches `tokenizer.decode(output_ids)` for byte-level BPE. SentencePiece tokenizers
    differ in one place: the first output token's leading space is kept, since the output
    continues the prompt (as in vLLM), whereas a decode of the output alone strips it.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode = _decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop_str = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output tokens seen, decoded or not
        # Where the text of the first min_tokens tokens ends: no stop string may end before.
        self._min_tokens_text_end = 0
        # Decoded last time; starts on a character boundary, which byte-fallback decoders need
        # (they turn a whole run of byte tokens into U+FFFDs if it does not decode).
        self._context: list[int] = self._prompt_context(prompt_token_ids)
        self._pending: list[int] = []  # not in the text yet
        self._text = ""
        self._num_sent_chars = 0  # how much of the text deltas have already returned
        self._matched_stop: str | None = None

    @property
    def output_text(self) -> str:
        """All the output text so far, never ending in an incomplete character."""
        return self._text

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Append the new tokens' text; return the stop string that ends the output, if any.

        `stop_terminated`: the last token ended the request (EOS or a stop token); its text is
        left out unless include_stop_str_in_output, as in vLLM. The text is cut before a stop
        string (after it with include_stop_str_in_output). A stop string counts only if it ends
        in the new text and after the text of the first min_tokens tokens, and the one that ends
        first wins, so the result does not depend on how tokens were grouped into updates.
        """
        if self._matched_stop is not None:
            raise RuntimeError(f"output already stopped at {self._matched_stop!r}")
        old_len = len(self._text)
        skipped = stop_terminated and not self._include_stop_str and bool(new_token_ids)
        for token_id in new_token_ids[:-1] if skipped else new_token_ids:
            self._decode_next(token_id)
            self._num_tokens += 1
            if self._num_tokens <= self._min_tokens:
                self._min_tokens_text_end = len(self._text)
        self._num_tokens += skipped
        if not self._stop or self._num_tokens <= self._min_tokens or len(self._text) == old_len:
            return None
        return self._find_stop(max(old_len, self._min_tokens_text_end))

    def update_until_stop(
        self, new_token_ids: Sequence[int], stop_terminated: bool = False
    ) -> tuple[int, str | None]:
        """`update`, token by token when several tokens arrive at once (accepted drafts) and
        stop strings are set: how many of the tokens the output keeps (up to the one that
        completes a stop string), and that stop string."""
        if not self._stop or len(new_token_ids) == 1:
            return len(new_token_ids), self.update(new_token_ids, stop_terminated)
        for count in range(1, len(new_token_ids) + 1):
            is_last = count == len(new_token_ids)
            stop = self.update(new_token_ids[count - 1 : count], stop_terminated and is_last)
            if stop is not None:
                return count, stop
        return len(new_token_ids), None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: everything so far, or (delta) what the last call did not return.

        Until finished, a tail that could be the start of a stop string is held back, so a
        client never sees text that the stop string later removes.
        """
        end = len(self._text) if finished else len(self._text) - self._stop_prefix_len()
        if not delta:
            return self._text[:end]
        start = self._num_sent_chars
        if end <= start:
            return ""
        self._num_sent_chars = end
        return self._text[start:end]

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, minus leading ones that end a character begun before them."""
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).startswith(REPLACEMENT_CHAR):
            context.pop(0)
        return context

    def _decode_next(self, token_id: int) -> None:
        """Add one token: its text joins the output once it does not end mid-character."""
        self._pending.append(token_id)
        prefix_text = self._decode(self._context)
        full_text = self._decode(self._context + self._pending)
        if full_text == prefix_text and self._is_skipped(token_id):
            # It never adds text, so dropping it keeps the window small however many special
            # tokens arrive in a row.
            self._pending.pop()
        elif len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._text += full_text[len(prefix_text) :]
            self._context, self._pending = self._pending, []

    def _is_skipped(self, token_id: int) -> bool:
        """A special token that skip_special_tokens removes (only asked when no text was added)."""
        return (
            self._skip_special_tokens
            and not self._decode([token_id])
            and bool(self._tokenizer.decode([token_id], skip_special_tokens=False))
        )

    def _find_stop(self, floor: int) -> str | None:
        """Of the stop strings that end after `floor`, the one that ends first; cut the text."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stop:
            start = self._text.find(stop, max(0, floor - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return None
        end, start, stop = best
        self._text = self._text[: end if self._include_stop_str else start]
        self._matched_stop = stop
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self._include_stop_str or self._matched_stop is not None:
            return 0  # the held text would be shown either way, or the text is final
        for length in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
