"""How to pick tokens and when to stop: the per-request knobs, with vLLM's names, order,
defaults and validation, so `from tandem import SamplingParams` is a drop-in for vLLM's.

Wrong types raise TypeError and bad values ValueError, each naming the field (the message starts
with it, which the server uses to blame the request field) and what is allowed. Objects cross the
process boundary as msgspec msgpack (engine/messages.py): every field is plain data, and
__post_init__ runs again on decode, so it only normalises what is already normal.
"""

from __future__ import annotations

import copy
import enum
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal

# Below this temperature the logits / temperature division overflows float32 for ordinary logits,
# and the distribution is a one-hot anyway, so it is sampled as argmax (vLLM uses the same cut).
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for logit_bias values; vLLM clamps to it. Larger biases would overflow float32.
LOGIT_BIAS_LIMIT = 100.0
# What logprobs are taken from (vLLM's logprobs_mode): the model's raw logits, or the ones the
# token was drawn from (after bans, bias, penalties, temperature and the top-k/top-p/min-p cuts).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class RequestOutputKind(enum.Enum):
    """Which RequestOutputs a request yields (vLLM's enum, same members and values)."""

    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


# -- validation helpers: TypeError for the wrong kind of value, ValueError for a bad value ------


def _type_error(name: str, value: object, allowed: str) -> TypeError:
    return TypeError(f"{name} must be {allowed}, got {value!r} of type {type(value).__name__}")


def _is_int(value: object) -> bool:
    """bool is an int subclass; `max_tokens=True` is a bug in the caller, not the value 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int, allowed: str, minus_one: bool = False):
    """An int >= minimum (or -1 where -1 means "all"/"as large as possible")."""
    if not _is_int(value):
        raise _type_error(name, value, allowed)
    if value < minimum and not (minus_one and value == -1):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(
    name: str, value: object, low: float, high: float, allowed: str, low_open: bool = False
) -> None:
    """Also rejects NaN and infinities, which slip past range comparisons or poison the logits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, value, allowed)
    if not math.isfinite(value) or not low <= value <= high or (low_open and value == low):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _type_error(name, value, "True or False")


def _list(name: str, value: object, allowed: str) -> list:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise _type_error(name, value, allowed)
    return list(value)


def _token_id_list(name: str, value: object) -> list[int]:
    allowed = "a list of token ids (ints >= 0)"
    ids = _list(name, value, allowed)
    for token_id in ids:
        _check_int(name, token_id, 0, allowed)
    return ids


def _string_list(name: str, value: object, allowed: str, one: bool = False) -> list[str]:
    """A list of non-empty strings (or, with `one`, a single string), as a new list without
    repeats."""
    strings = [value] if one and isinstance(value, str) else _list(name, value, allowed)
    for string in strings:
        if not isinstance(string, str):
            raise _type_error(name, string, allowed)
        if not string:
            raise ValueError(f"{name} must be {allowed}, got {strings!r}")
    return list(dict.fromkeys(strings))


def _logit_bias(value: object) -> dict[int, float]:
    """Token id -> bias, clamped to [-100, 100] as OpenAI documents it (and vLLM applies it)."""
    allowed = "a dict of token id (int >= 0) -> bias (a number)"
    if not isinstance(value, Mapping):
        raise _type_error("logit_bias", value, allowed)
    bias = {}
    for token_id, amount in value.items():
        _check_int("logit_bias", token_id, 0, allowed)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise _type_error("logit_bias", amount, allowed)
        if math.isnan(amount):
            raise ValueError(f"logit_bias must be {allowed}, got NaN for token {token_id}")
        bias[token_id] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(amount)))
    return bias


def num_top_logprobs(requested: int, vocab_size: int) -> int:
    """How many top tokens a logprobs count asks for: -1 is the whole vocabulary (vLLM)."""
    return vocab_size if requested == -1 else min(requested, vocab_size)


def truncate_prompt(
    prompt_token_ids: Sequence[int],
    truncate_prompt_tokens: int | None,
    max_model_len: int,
    side: Literal["left", "right"] = "left",
) -> list[int]:
    """The prompt's last k = truncate_prompt_tokens tokens (k = max_model_len for -1; the whole
    prompt for None), as vLLM truncates (from the left), or its first k (`side` "right", the
    server's `truncation_side`). k above max_model_len is a ValueError, as in vLLM: the prompt
    could not run anyway."""
    k = truncate_prompt_tokens
    if k is None:
        return list(prompt_token_ids)
    if k == -1:
        k = max_model_len
    elif k > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens must be <= max_model_len ({max_model_len}), got {k}: "
            "choose a smaller truncation size"
        )
    return list(prompt_token_ids[:k] if side == "right" else prompt_token_ids[-k:])


def tokenize_bad_words(bad_words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's bad-word token sequences: each word as tokenized at the start of a text, and once
    more with a leading space when that gives a different first token but as many tokens (the
    word in mid-text, for tokenizers that fold the space into the word's first token)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ValueError(f"bad_words must each tokenize to at least one token, got {word!r}")
        sequences.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(list(spaced))
    return sequences


@dataclass
class StructuredOutputsParams:
    """Output held to a grammar (vLLM's class of this name): exactly one of a JSON schema
    (`json`, an object or its JSON text), any JSON object (`json_object`), a `regex`, one of
    the strings in `choice`, or an EBNF `grammar` (xgrammar's dialect, GBNF-like). The engine
    core compiles it (engine/structured_outputs.py) and masks every token that would leave it;
    the reply ends when the grammar allows nothing but its end (EOS)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False  # no other backend to fall back to: nothing to disable
    disable_any_whitespace: bool = False  # JSON with json.dumps's separators, no other space
    disable_additional_properties: bool = False  # tandem's schemas allow none unless listed
    whitespace_pattern: str | None = None  # outlines' knob; refused
    structural_tag: str | None = None  # refused

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _type_error("structured_outputs.json", self.json, "a JSON schema (dict or str)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _type_error(f"structured_outputs.{name}", value, "a string")
        if self.choice is not None:
            self.choice = _string_list("structured_outputs.choice", self.choice,
                                       "a list of non-empty strings")  # fmt: skip
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            _check_bool(f"structured_outputs.{name}", getattr(self, name))
        if self.json_object is not None:
            _check_bool("structured_outputs.json_object", self.json_object)
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"structured_outputs.{name} is not supported by tandem yet (its grammar "
                    "engine, xgrammar, has no such option here); leave it out"
                )

    @property
    def kind(self) -> str:
        """Which of KINDS the grammar is given as (exactly one is: __post_init__)."""
        return self._given()[0]

    def _given(self) -> list[str]:
        return [name for name in self.KINDS if getattr(self, name) not in (None, False, [])]


@dataclass
class SamplingParams:
    """Per-request sampling settings; invalid values are rejected when the object is built, so a
    bad request fails at the API boundary instead of inside a running batch.

    Token-id checks that need the model (ids within the vocabulary) are `check_vocab`'s; bad_words
    become token sequences in `update_from_tokenizer`, which the engine front end calls.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None  # -1 means None, as in vLLM
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    # Words that may not be generated: the last token of a word's token sequence is banned
    # whenever the tokens just generated are the rest of it.
    bad_words: list[str] | None = None  # normalised to a list
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings are held off until then
    logprobs: int | None = None  # top-N per output token (+ the sampled one); -1: all
    # Logprobs of the prompt tokens (each with its rank) plus the top-N at every prompt position
    # (RequestOutput.prompt_logprobs); -1: all. Such a request computes its whole prompt: no
    # prefix-cache hits, as in vLLM. Always from the raw logits, whatever logprobs_mode says.
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: text stays "", token ids only
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # honoured by slow tokenizers, as in vLLM
    include_stop_str_in_output: bool = False  # also keeps a stop token's text
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None  # added to the logits; clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Keep only the last k prompt tokens (-1: the last max_model_len); see truncate_prompt.
    truncate_prompt_tokens: int | None = None
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES; vLLM has it engine-wide
    # vLLM's: with logprobs, each output token's logprobs give these tokens (and the sampled
    # one), each with its rank, in place of the top-N (scoring a fixed set of labels).
    logprob_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # output held to a grammar
    # vLLM v1 refuses these two; they exist so the refusal says why instead of a TypeError.
    best_of: int | None = None  # must be None or equal n
    logits_processors: list[Any] | None = None  # must be None or empty
    # bad_words as token sequences (update_from_tokenizer); travels to the engine core.
    _bad_words_token_ids: list[list[int]] | None = None

    # Names of the fields the caller passed to the constructor (or from_optional with a value):
    # the model's generation-config defaults fill the others (with_defaults).
    _fields_set: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        self.stop = [] if self.stop is None else _string_list(
            "stop", self.stop, "a non-empty string or a list of them", one=True
        )  # fmt: skip
        self.bad_words = [] if self.bad_words is None else _string_list(
            "bad_words", self.bad_words, "a list of non-empty strings"
        )  # fmt: skip
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = list(dict.fromkeys(_token_id_list("stop_token_ids", ids)))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list("allowed_token_ids", self.allowed_token_ids)
        if self.logprob_token_ids is not None:
            ids = _token_id_list("logprob_token_ids", self.logprob_token_ids)
            self.logprob_token_ids = list(dict.fromkeys(ids)) or None  # []: the top-N, as None
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        # vLLM reads logprobs=True as 1
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise _type_error(
                "structured_outputs", self.structured_outputs, "a StructuredOutputsParams"
            )
        self._validate_numbers()
        self._validate_flags()
        self._validate_refused()

    def _validate_numbers(self) -> None:
        _check_int("n", self.n, 1, ">= 1")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "> 0 (finite)",
                     low_open=True)  # fmt: skip
        _check_float("temperature", self.temperature, 0.0, math.inf, ">= 0 (finite)")
        _check_float("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", low_open=True)
        _check_int("top_k", self.top_k, -1, ">= -1 (0 or -1 disables it)")
        _check_float("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), "an int or None")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, ">= 1 or None")
        _check_int("min_tokens", self.min_tokens, 0, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, ">= 0, -1 (the whole vocabulary) or None", True)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1,
                       ">= 1, -1 (max_model_len) or None", minus_one=True)  # fmt: skip
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError(
                "allowed_token_ids must hold at least one token id (None allows every token)"
            )
        if self.logprob_token_ids and self.logprobs is None:
            raise ValueError(
                "logprob_token_ids gives the logprobs of those tokens, which needs logprobs set "
                "(any count: the ids replace the top-N)"
            )

    def _validate_flags(self) -> None:
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):  # fmt: skip
            _check_bool(name, getattr(self, name))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _type_error("output_kind", self.output_kind, "a RequestOutputKind")
        if not isinstance(self.logprobs_mode, str):
            raise _type_error("logprobs_mode", self.logprobs_mode, f"one of {LOGPROBS_MODES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are matched on the detokenized text: they need detokenize=True "
                "(give stop_token_ids to stop on token ids alone)"
            )

    def _validate_refused(self) -> None:
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1, "None or equal to n")
            if self.best_of != self.n:
                raise ValueError(
                    f"best_of must be None or equal to n, got best_of={self.best_of} and "
                    f"n={self.n}: like vLLM v1, tandem does not generate extra candidates to "
                    "return the best ones; ask for n sequences and rank them yourself"
                )
        if self.logits_processors:
            raise ValueError(
                "logits_processors are not supported: like vLLM v1, tandem does not run "
                "per-request Python callbacks inside the batched sampler; use logit_bias, "
                "allowed_token_ids or bad_words"
            )

    # -- what the engine asks ----------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: no randomness, so the seed and top_p/min_p do not matter."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """bad_words as token sequences, once update_from_tokenizer has run (vLLM's name)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize bad_words (in place, as vLLM does); a no-op without them."""
        if self.bad_words:
            self._bad_words_token_ids = tokenize_bad_words(self.bad_words, tokenizer)

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError, naming the field, for token ids the model does not have."""
        fields_ids = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "logprob_token_ids": self.logprob_token_ids or [],
            "bad_words": [t for seq in self._bad_words_token_ids or () for t in seq],
        }
        for name, ids in fields_ids.items():
            bad = sorted({t for t in ids if t >= vocab_size})
            if bad:
                raise ValueError(
                    f"{name} has token ids outside the vocabulary: {bad[:10]} (ids must be in "
                    f"[0, {vocab_size}))"
                )

    def truncate_prompt(self, prompt_token_ids: Sequence[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens leaves it (see truncate_prompt)."""
        return truncate_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    # -- building --------------------------------------------------------------------------

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields the caller set explicitly (constructor keywords and positionals, or
        from_optional's non-None values); the rest are defaults that with_defaults may fill."""
        return self._fields_set

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's from_optional: None means the field's default (and does not count as set),
        except max_tokens=None, which stays None (no limit) as in vLLM. logit_bias may have
        string keys (JSON's), which become token ids."""
        given = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        bias = given.get("logit_bias")
        if isinstance(bias, Mapping):
            given["logit_bias"] = {_token_id_key(key): value for key, value in bias.items()}
        return cls(**given)

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """A copy with `defaults` (e.g. generation_config_defaults(model)) in every field the
        caller did not set; fields they set keep their values. Raises as the constructor does
        if the result is inconsistent (e.g. a default max_tokens below an explicit min_tokens)."""
        changes = {k: v for k, v in defaults.items() if k not in self._fields_set}
        if not changes:
            return self
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"defaults name fields SamplingParams does not have: {unknown}")
        result = replace(self, **changes)
        result._fields_set = self._fields_set
        return result

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's clone)."""
        return copy.deepcopy(self)


def _token_id_key(key: object) -> object:
    """A logit_bias key as sent in JSON ("123") becomes the token id 123."""
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ValueError(
                f"logit_bias keys must be token ids, got {key!r}, which is not an integer"
            ) from None
    return key


def _record_fields_set(init):
    """Wrap the dataclass __init__ to remember which fields the caller passed."""
    names = [f.name for f in fields(SamplingParams) if f.init]

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._fields_set = frozenset(names[: len(args)]) | frozenset(kwargs)

    return __init__


SamplingParams.__init__ = _record_fields_set(SamplingParams.__init__)  # type: ignore[method-assign]
