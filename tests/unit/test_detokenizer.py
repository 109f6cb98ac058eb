"""Incremental detokenizer: the streamed text equals a one-shot decode however the tokens arrive,
never shows a half-built character, and stops where the first stop string ends."""

from __future__ import annotations

import random
import string
from collections.abc import Iterator, Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tandem.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tandem.engine.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🎉 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 end",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Accents: café, naïve, façade, Ångström, e\u0301 (combining), ñandú",
    "def f(x):\n    if x > 0:\n\t\treturn x  # two  spaces\n\n    return -x\r\n",
    "  leading spaces, trailing spaces   ",
    "mixed🙂中a\u00e9\n🦀 Rust + 🐍 Python = ❤️",
]
CHAT_PROMPT = "<|im_start|>user\nSay hi 👋<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm() -> PreTrainedTokenizerBase:
    """The real byte-level BPE tokenizer of the embedded model."""
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerBase:
    """A Llama-style tokenizer built in memory: '▁' for spaces, <0xNN> byte fallback for every
    character outside its ASCII vocabulary, and a decoder that strips the leading space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "▁" + string.ascii_letters + string.digits + string.punctuation:
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def random_chunks(ids: list[int], rng: random.Random) -> Iterator[list[int]]:
    start = 0
    while start < len(ids):
        size = rng.randint(1, 5)
        yield ids[start : start + size]
        start += size


def stream(
    tokenizer: PreTrainedTokenizerBase,
    chunks: Sequence[list[int]],
    prompt: Sequence[int] = (),
    clean: bool = True,
    **kwargs: object,
) -> tuple[IncrementalDetokenizer, str | None, list[str]]:
    """Feed the chunks as engine steps would, collecting every delta; stop at a stop string.
    `clean`: the text has no U+FFFD, so none may ever be shown."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    deltas: list[str] = []
    stop = None
    for chunk in chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if clean:
            assert REPLACEMENT_CHAR not in detok.output_text + deltas[-1]
        if stop is not None:
            break
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == detok.output_text
    return detok, stop, deltas


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[token_id] for token_id in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_decode(smollm, text):
    ids = encode(smollm, text)
    expected = smollm.decode(ids)
    assert expected == text
    rng = random.Random(text)
    for chunks in [one_by_one(ids), [ids], *(list(random_chunks(ids, rng)) for _ in range(5))]:
        for prompt in [(), encode(smollm, CHAT_PROMPT)]:
            detok, stop, _ = stream(smollm, chunks, prompt)
            assert stop is None
            assert detok.output_text == expected


def test_character_split_over_tokens_is_held_until_complete(smollm):
    ids = encode(smollm, "a😀")  # the emoji's 4 bytes span 2 tokens
    assert smollm.decode(ids[:-1]).endswith(REPLACEMENT_CHAR)
    detok = IncrementalDetokenizer(smollm, [])
    detok.update(ids[:-1])
    # An output that ends here (max_tokens) ends before the partial character, as in vLLM.
    assert detok.output_text == "a"
    assert detok.get_next_output_text(finished=False, delta=True) == "a"
    detok.update(ids[-1:])
    assert detok.get_next_output_text(finished=False, delta=True) == "😀"
    assert detok.output_text == "a😀"


def test_invalid_bytes_inside_the_text_are_shown_as_decode_shows_them(smollm):
    lone_continuation_byte = smollm.convert_tokens_to_ids("Ģ")  # byte 0x80
    ids = [*encode(smollm, "x"), lone_continuation_byte, *encode(smollm, "yz")]
    detok, _, _ = stream(smollm, one_by_one(ids), clean=False)
    assert detok.output_text == smollm.decode(ids) == f"x{REPLACEMENT_CHAR}yz"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(smollm, skip):
    ids = encode(smollm, "Hi<|im_end|>there<|endoftext|>")
    detok, _, _ = stream(smollm, one_by_one(ids), skip_special_tokens=skip)
    assert detok.output_text == smollm.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == ("Hithere" if skip else "Hi<|im_end|>there<|endoftext|>")


class CountingTokenizer:
    """Records the longest id list the detokenizer ever asks to decode."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.longest = max(self.longest, len(ids))
        self.kwargs = kwargs
        return self.tokenizer.decode(ids, **kwargs)


def test_decode_window_stays_small(smollm):
    """O(new tokens) per step: a long output, or a long run of skipped special tokens, never
    makes the decoded window grow."""
    specials = encode(smollm, "<|im_end|>" * 300)
    ids = encode(smollm, " ".join(TEXTS) * 5) + specials + encode(smollm, " after 😀")
    counting = CountingTokenizer(smollm)
    detok, _, _ = stream(counting, one_by_one(ids), encode(smollm, CHAT_PROMPT))
    assert detok.output_text == smollm.decode(ids, skip_special_tokens=True)
    assert counting.longest <= 8


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_stream_equals_decode(sentencepiece, text):
    ids = encode(sentencepiece, text)
    assert any(t.startswith("<0x") for t in sentencepiece.convert_ids_to_tokens(ids)) or (
        text.isascii()
    )
    rng = random.Random(text)
    for chunks in [one_by_one(ids), *(list(random_chunks(ids, rng)) for _ in range(5))]:
        detok, _, _ = stream(sentencepiece, chunks)
        assert detok.output_text == sentencepiece.decode(ids)


def test_sentencepiece_output_keeps_its_leading_space_after_a_prompt(sentencepiece):
    """The known difference from decode(output ids): the output continues the prompt, so the
    space the decoder strips at the start of a decode is kept, as in vLLM."""
    prompt, output = encode(sentencepiece, "in 世界"), encode(sentencepiece, "the 好 cat")
    detok, _, _ = stream(sentencepiece, one_by_one(output), prompt)
    assert sentencepiece.decode(output) == "the 好 cat"
    full, prompt_text = sentencepiece.decode(prompt + output), sentencepiece.decode(prompt)
    assert detok.output_text == full[len(prompt_text) :] == " the 好 cat"


def test_prompt_context_starts_on_a_character_boundary(sentencepiece):
    """The prompt's last tokens end in byte tokens that begin mid-character; byte fallback turns
    a run of bytes that does not decode into U+FFFDs as a whole, so that run must not be
    context for output bytes."""
    prompt = encode(sentencepiece, "in 世界")
    assert sentencepiece.decode(prompt[-5:]).startswith(REPLACEMENT_CHAR)
    output = sentencepiece.convert_tokens_to_ids(["<0xE5>", "<0xA5>", "<0xBD>"])  # 好
    output += encode(sentencepiece, "the end")
    detok, _, _ = stream(sentencepiece, one_by_one(output), prompt)
    full, prompt_text = sentencepiece.decode(prompt + output), sentencepiece.decode(prompt)
    assert detok.output_text == full[len(prompt_text) :] == "好 the end"


def build_ids(tokenizer: PreTrainedTokenizerBase, pieces: list[str]) -> list[int]:
    """Token ids whose boundaries fall (at least) between the given pieces."""
    return [token_id for piece in pieces for token_id in encode(tokenizer, piece)]


@pytest.mark.parametrize(
    "include,expected", [(False, "The answer is 4"), (True, "The answer is 42 END")]
)
def test_stop_string_split_across_tokens(smollm, include, expected):
    ids = build_ids(smollm, ["The answer is 4", "2 E", "ND", " and more text"])
    for chunks in [one_by_one(ids), [ids], [ids[:3], ids[3:]]]:
        detok, stop, _ = stream(
            smollm, chunks, stop=["nothing", "2 END"], include_stop_str_in_output=include
        )
        assert stop == "2 END"
        assert detok.output_text == expected
    with pytest.raises(RuntimeError):
        detok.update(ids[:1])


@pytest.mark.parametrize(
    "stops,expected_stop,expected_text",
    [
        (["fox", "quick"], "quick", "the "),  # earlier in the text, later in the list
        (["quick brown", "ick"], "ick", "the qu"),  # ends first though it starts later
        (["ck", "quick"], "quick", "the "),  # same end: the longer, earlier-starting one
        (["🦊", "dog"], "🦊", "the quick brown "),  # a stop string that is a split character
    ],
)
def test_first_stop_string_to_end_wins(smollm, stops, expected_stop, expected_text):
    ids = build_ids(smollm, ["the qu", "ick brown 🦊 fox jumps over the dog"])
    rng = random.Random(0)
    for chunks in [one_by_one(ids), [ids], *(list(random_chunks(ids, rng)) for _ in range(10))]:
        detok, stop, _ = stream(smollm, chunks, stop=stops)
        assert (stop, detok.output_text) == (expected_stop, expected_text)


def test_delta_holds_back_a_possible_stop_string_start(smollm):
    detok = IncrementalDetokenizer(smollm, [], stop=["world"])
    detok.update(build_ids(smollm, ["Hello wo"]))
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello "
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello "
    detok.update(build_ids(smollm, ["nder"]))  # not the stop string after all: released
    assert detok.get_next_output_text(finished=False, delta=True) == "wonder"
    detok.update(build_ids(smollm, [" w"]))
    assert detok.get_next_output_text(finished=False, delta=True) == " "
    assert detok.get_next_output_text(finished=True, delta=True) == "w"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello wonder w"


def test_nothing_is_held_back_when_the_stop_string_is_kept(smollm):
    detok = IncrementalDetokenizer(smollm, [], stop=["world"], include_stop_str_in_output=True)
    detok.update(build_ids(smollm, ["Hello wo"]))
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello wo"


def test_random_streams_with_stops_match_a_one_shot_reference(smollm):
    """Fuzz: any text, stops and chunking give decode(ids) cut where the first stop ends, and
    the deltas never show text the cut later removes (stream() checks their concatenation)."""
    rng = random.Random(1234)
    alphabet = [*"ab ,.\n", "é", "😀", "中", "ab"]
    for _ in range(200):
        ids = encode(smollm, "".join(rng.choices(alphabet, k=rng.randint(1, 30))))
        text = smollm.decode(ids)
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 3))) for _ in range(3)]
        include = rng.random() < 0.5
        found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if found:
            end, start, expected_stop = min(found)
            expected_text = text[: end if include else start]
        else:
            expected_stop, expected_text = None, text
        detok, stop, _ = stream(
            smollm, list(random_chunks(ids, rng)), stop=stops, include_stop_str_in_output=include
        )
        assert (stop, detok.output_text) == (expected_stop, expected_text), (text, stops)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_leaves_its_text_out(smollm, include):
    """vLLM: the token that ended the request (a stop token id, or EOS) is not shown unless
    include_stop_str_in_output; without a stop string nothing else changes."""
    ids = encode(smollm, "Once upon a time, storytelling")
    for chunks in [one_by_one(ids), [ids], [ids[:2], ids[2:]]]:
        detok = IncrementalDetokenizer(smollm, [], include_stop_str_in_output=include)
        for index, chunk in enumerate(chunks):
            assert detok.update(chunk, stop_terminated=index == len(chunks) - 1) is None
        full = smollm.decode(ids)
        expected = full if include else smollm.decode(ids[:-1])
        assert detok.output_text == expected
        assert detok.get_next_output_text(finished=True, delta=False) == expected
    assert expected.endswith(" storytelling") == include


def test_a_stop_string_before_the_stop_token_still_counts(smollm):
    ids = build_ids(smollm, ["Hello world", " again"])
    detok = IncrementalDetokenizer(smollm, [], stop=["world"])
    assert detok.update(ids, stop_terminated=True) == "world"
    assert detok.output_text == "Hello "


def test_stop_strings_wait_for_min_tokens(smollm):
    """A stop string counts only once min_tokens tokens exist and only if it ends in text
    after theirs (it may begin in it), as in vLLM."""
    pieces = ["e", "x", "e", "y", "e", "z"]
    ids = build_ids(smollm, pieces)
    assert len(ids) == len(pieces)
    rng = random.Random(5)
    for chunks in [one_by_one(ids), [ids], *(list(random_chunks(ids, rng)) for _ in range(10))]:
        for min_tokens, stop, expected_text in [
            (0, "e", ""),  # the first token
            (1, "e", "ex"),  # the third
            (3, "e", "exey"),  # the fifth
            (5, "e", None),  # none after the fifth token
            (2, "xe", "e"),  # begins within the first two tokens, ends in the third
            (3, "xe", None),
        ]:
            detok, found, _ = stream(smollm, chunks, stop=[stop], min_tokens=min_tokens)
            assert found == (None if expected_text is None else stop)
            assert detok.output_text == ("exeyez" if expected_text is None else expected_text)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_reach_the_tokenizer(smollm, spaces):
    counting = CountingTokenizer(smollm)
    ids = encode(smollm, "a<|im_end|><|im_start|>b")
    detok, _, _ = stream(counting, [ids], skip_special_tokens=False,
                         spaces_between_special_tokens=spaces)  # fmt: skip
    assert counting.kwargs == {"skip_special_tokens": False,
                               "spaces_between_special_tokens": spaces}  # fmt: skip
    # a fast tokenizer (like vLLM's fast path) ignores it
    assert detok.output_text == "a<|im_end|><|im_start|>b"
