"""SamplingParams: vLLM's names, defaults and validation (TypeError for the wrong kind of value,
ValueError for a bad value, each naming the field), the helpers the engine calls (bad words,
vocab checks, prompt truncation, generation-config defaults) and the msgpack round trip the
server's process boundary needs."""

import dataclasses
import json
import math
import re

import msgspec
import pytest

from tandem.engine.messages import AddRequest
from tandem.engine.tokenizer import load_tokenizer
from tandem.generation_config import generation_config_defaults
from tandem.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    num_top_logprobs,
    tokenize_bad_words,
    truncate_prompt,
)


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert params.n == 1
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.min_p == 0.0
    assert params.seed is None
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.bad_words == []
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert params.prompt_logprobs is None
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.detokenize is True
    assert params.skip_special_tokens is True
    assert params.spaces_between_special_tokens is True
    assert params.include_stop_str_in_output is False
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert (params.logit_bias, params.allowed_token_ids) == (None, None)
    assert params.truncate_prompt_tokens is None
    assert params.logprobs_mode == "raw_logprobs"
    assert (params.best_of, params.logits_processors) == (None, None)


def test_positional_order_is_vllms() -> None:
    """vLLM's first fields, in its order: n, presence, frequency, repetition, temperature, ..."""
    params = SamplingParams(2, 0.1, 0.2, 1.3, 0.5, 0.9, 7, 0.01, 42)
    assert (params.n, params.presence_penalty, params.frequency_penalty) == (2, 0.1, 0.2)
    assert (params.repetition_penalty, params.temperature, params.top_p) == (1.3, 0.5, 0.9)
    assert (params.top_k, params.min_p, params.seed) == (7, 0.01, 42)


def test_output_kind_is_vllms_enum() -> None:
    assert [(k.name, k.value) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0),
        ("DELTA", 1),
        ("FINAL_ONLY", 2),
    ]


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_lists_are_copied_and_deduplicated() -> None:
    stop, stop_token_ids, bad = ["x"], [5, 5, 6], ["w", "w"]
    params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids, bad_words=bad)
    stop.append("y")
    stop_token_ids.append(7)
    assert params.stop == ["x"]
    assert params.stop_token_ids == [5, 6]
    assert params.bad_words == ["w"]


def test_unlimited_max_tokens_is_allowed() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_vllm_shorthands() -> None:
    """seed=-1 means no seed; logprobs=True means 1 (both as in vLLM)."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"temperature": math.inf}, "temperature must be >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= -1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"bad_words": ["ok", ""]}, "bad_words must be a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids (ints >= 0)"),
        ({"logprobs": -2}, "logprobs must be >= 0, -1 (the whole vocabulary) or None, got -2"),
        ({"prompt_logprobs": -5}, "prompt_logprobs must be >= 0, -1 (the whole vocabulary)"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
        ({"allowed_token_ids": []}, "allowed_token_ids must hold at least one token id"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be a list of token ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must be a dict of token id (int >= 0)"),
        ({"logit_bias": {3: math.nan}}, "logit_bias must be a dict of token id"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1, -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= 1, -1"),
        ({"logprobs_mode": "logits"}, "logprobs_mode must be one of ('raw_logprobs'"),
        ({"stop": "x", "detokenize": False}, "stop strings are matched on the detokenized"),
        ({"best_of": 2}, "best_of must be None or equal to n, got best_of=2 and n=1"),
        ({"n": 2, "best_of": 3}, "does not generate extra candidates"),
        ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors are not"),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)
    assert not isinstance(excinfo.value, TypeError)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 1.0}, "n must be >= 1, got 1.0 of type float"),
        ({"seed": 1.5}, "seed must be an int or None, got 1.5 of type float"),
        ({"max_tokens": True}, "max_tokens must be >= 1 or None, got True of type bool"),
        ({"max_tokens": "16"}, "max_tokens must be >= 1 or None, got '16' of type str"),
        ({"temperature": "0.5"}, "temperature must be >= 0 (finite), got '0.5' of type str"),
        ({"top_k": 2.0}, "top_k must be >= -1"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs must be >= 0, -1 (the whole vocabulary)"),
        ({"stop": 5}, "stop must be a non-empty string or a list of them, got 5 of type int"),
        ({"stop": ["a", 5]}, "stop must be a non-empty string or a list of them, got 5"),
        ({"bad_words": "word"}, "bad_words must be a list of non-empty strings, got 'word'"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids must be a list of token ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids must be a list of token ids"),
        ({"logit_bias": [(1, 2.0)]}, "logit_bias must be a dict of token id (int >= 0)"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias must be a dict of token id (int >= 0)"),
        ({"logit_bias": {5: "big"}}, "logit_bias must be a dict of token id"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False, got 1 of type int"),
        ({"detokenize": "no"}, "detokenize must be True or False"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be True or False"),
        ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens must be True"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be True"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind"),
        ({"logprobs_mode": 1}, "logprobs_mode must be one of"),
        ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens must be >= 1, -1"),
        ({"best_of": 2.0}, "best_of must be None or equal to n"),
    ],
)
def test_wrong_types_are_type_errors_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"top_p": 1e-3},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1.3},
        {"logprobs": 0},
        {"logprobs": -1},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 20},
        {"prompt_logprobs": -1},
        {"seed": 0},
        {"min_tokens": 16, "max_tokens": 16},
        {"best_of": 1},
        {"n": 3, "best_of": 3},
        {"logits_processors": []},
        {"allowed_token_ids": [0]},
        {"logit_bias": {0: -100, 7: 2}},
        {"truncate_prompt_tokens": -1},
        {"truncate_prompt_tokens": 1},
        {"detokenize": False, "stop_token_ids": [3]},
        {"logprobs_mode": "raw_logprobs"},
        {"logprobs_mode": "raw_logits"},
        {"logprobs_mode": "processed_logprobs"},
        {"logprobs_mode": "processed_logits"},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_logit_bias_is_clamped_to_openais_range() -> None:
    params = SamplingParams(logit_bias={1: 250.0, 2: -math.inf, 3: 0.5, 4: 7})
    assert params.logit_bias == {1: 100.0, 2: -100.0, 3: 0.5, 4: 7.0}


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 1e-7}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({}, False),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"top_k": 0}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_num_top_logprobs_reads_minus_one_as_the_vocabulary() -> None:
    assert num_top_logprobs(-1, 500) == 500
    assert num_top_logprobs(5, 500) == 5
    assert num_top_logprobs(900, 500) == 500


# -- which fields the caller set, from_optional, with_defaults --------------------------------


def test_fields_set_are_the_ones_passed() -> None:
    assert SamplingParams().fields_set == frozenset()
    assert SamplingParams(temperature=1.0, max_tokens=5).fields_set == {"temperature", "max_tokens"}
    assert SamplingParams(3, 0.5).fields_set == {"n", "presence_penalty"}


def test_from_optional_reads_none_as_the_default() -> None:
    params = SamplingParams.from_optional(
        n=None, temperature=None, top_p=None, top_k=None, min_p=None, seed=None, stop=None,
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None, logprobs=None,
    )  # fmt: skip
    assert params == SamplingParams()
    assert params.fields_set == frozenset()
    params = SamplingParams.from_optional(temperature=0.3, top_k=None)
    assert (params.temperature, params.top_k, params.fields_set) == (0.3, 0, {"temperature"})
    # max_tokens=None is vLLM's "no limit", not the default 16
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None
    assert SamplingParams.from_optional().max_tokens == 16


def test_from_optional_takes_json_logit_bias_keys() -> None:
    params = SamplingParams.from_optional(logit_bias={"50256": -100, "7": 3.5})
    assert params.logit_bias == {50256: -100.0, 7: 3.5}
    with pytest.raises(ValueError, match="logit_bias keys must be token ids, got 'abc'"):
        SamplingParams.from_optional(logit_bias={"abc": 1.0})


def test_with_defaults_fills_only_what_the_caller_left_unset() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    params = SamplingParams(temperature=1.0, min_tokens=3).with_defaults(defaults)
    assert params.temperature == 1.0  # set explicitly, even to the default value
    assert (params.top_p, params.top_k, params.max_tokens, params.min_tokens) == (0.9, 20, 64, 3)
    assert params.fields_set == {"temperature", "min_tokens"}
    assert SamplingParams().with_defaults({}) == SamplingParams()
    assert SamplingParams.from_optional(**defaults) == SamplingParams().with_defaults(defaults)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=100).with_defaults(defaults)
    with pytest.raises(ValueError, match="do_sample"):
        SamplingParams().with_defaults({"do_sample": True})


# -- engine helpers -----------------------------------------------------------------------------


def test_truncate_prompt_keeps_the_last_tokens() -> None:
    prompt = list(range(10))
    assert truncate_prompt(prompt, None, 100) == prompt
    assert truncate_prompt(prompt, 3, 100) == [7, 8, 9]
    assert truncate_prompt(prompt, 30, 100) == prompt
    assert truncate_prompt(prompt, -1, 4) == [6, 7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=2).truncate_prompt(prompt, 100) == [8, 9]
    # the server's truncation_side "right": the first k tokens
    assert truncate_prompt(prompt, 3, 100, "right") == [0, 1, 2]
    assert truncate_prompt(prompt, -1, 4, "right") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be <= max_model_len \(8\)"):
        truncate_prompt(prompt, 9, 8)


def test_check_vocab_names_the_field() -> None:
    SamplingParams(logit_bias={99: 1.0}, allowed_token_ids=[0, 99]).check_vocab(100)
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary: \[100"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match=r"allowed_token_ids has .*\[100, 200\]"):
        SamplingParams(allowed_token_ids=[1, 200, 100]).check_vocab(100)
    params = SamplingParams(bad_words=["x"], _bad_words_token_ids=[[5, 150]])
    with pytest.raises(ValueError, match=r"bad_words has token ids outside the vocabulary"):
        params.check_vocab(100)


@pytest.fixture(scope="module")
def smollm():
    return load_tokenizer("default")


def test_bad_words_are_tokenized_as_vllm_does(smollm) -> None:
    """Each word bare and, when that is a different token sequence of the same length, with a
    leading space (the word in mid-text)."""
    for word in ["storytelling", "hello", "Paris", " France", "New York"]:
        bare = smollm.encode(word.lstrip(), add_special_tokens=False)
        spaced = smollm.encode(" " + word.lstrip(), add_special_tokens=False)
        expected = [bare]
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            expected.append(spaced)
        assert tokenize_bad_words([word], smollm) == expected
    # " storytelling" is one token but "storytelling" two: only the bare form is kept, as vLLM
    assert len(tokenize_bad_words(["storytelling"], smollm)) == 1
    assert len(tokenize_bad_words(["hello"], smollm)) == 2
    params = SamplingParams(bad_words=["hello", "Paris"])
    assert params.bad_words_token_ids is None
    params.update_from_tokenizer(smollm)
    assert params.bad_words_token_ids == tokenize_bad_words(["hello", "Paris"], smollm)


# -- msgpack across the process boundary ----------------------------------------------------


def test_every_field_survives_msgpack() -> None:
    params = SamplingParams(
        n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7, stop=["a", "bc"],
        stop_token_ids=[3, 4], bad_words=["w"], ignore_eos=True, max_tokens=None, min_tokens=2,
        logprobs=-1, prompt_logprobs=-1, skip_special_tokens=False,
        spaces_between_special_tokens=False, include_stop_str_in_output=True,
        output_kind=RequestOutputKind.DELTA, logit_bias={5: -3.5, 9: 100.0},
        allowed_token_ids=[5, 9, 11], truncate_prompt_tokens=-1,
        logprobs_mode="processed_logits", logprob_token_ids=[4, 8], best_of=2,
        logits_processors=[], _bad_words_token_ids=[[1, 2], [3]],
        structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"a": {"type": ["integer", "null"]}}},
            disable_any_whitespace=True,
        ),
    )  # fmt: skip
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    changed = {name for name in names if getattr(params, name) != getattr(SamplingParams(), name)}
    assert changed == names - {"detokenize"}
    for original in (params, SamplingParams(detokenize=False)):
        data = msgspec.msgpack.encode(AddRequest("r", [1, 2], original, 0, 1.0))
        decoded = msgspec.msgpack.decode(data, type=AddRequest).sampling_params
        assert decoded == original
        for name in names:
            assert getattr(decoded, name) == getattr(original, name), name
    assert decoded.detokenize is False
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.output_kind is RequestOutputKind.DELTA
    assert decoded.bad_words_token_ids == [[1, 2], [3]]
    assert type(next(iter(decoded.logit_bias))) is int
    assert decoded.structured_outputs.json == params.structured_outputs.json
    for spec in (StructuredOutputsParams(choice=["a", "b"]), StructuredOutputsParams(regex="x+"),
                 StructuredOutputsParams(json='{"type": "string"}')):  # fmt: skip
        data = msgspec.msgpack.encode(SamplingParams(structured_outputs=spec))
        assert msgspec.msgpack.decode(data, type=SamplingParams).structured_outputs == spec


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({}, ValueError, "exactly one of json, regex, choice, grammar or json_object"),
        ({"regex": "a", "choice": ["a"]}, ValueError, "got ['regex', 'choice']"),
        ({"json_object": False}, ValueError, "exactly one"),
        ({"regex": 5}, TypeError, "structured_outputs.regex must be a string"),
        ({"json": 5}, TypeError, "structured_outputs.json must be a JSON schema"),
        ({"choice": ["a", ""]}, ValueError, "structured_outputs.choice"),
        ({"regex": "a", "whitespace_pattern": "[ ]?"}, ValueError, "not supported"),
        ({"regex": "a", "disable_any_whitespace": 1}, TypeError, "disable_any_whitespace"),
    ],
)
def test_structured_outputs_params_say_what_is_wrong(fields: dict, error: type, words: str):
    with pytest.raises(error, match=re.escape(words)):
        StructuredOutputsParams(**fields)
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


# -- the model's generation config --------------------------------------------------------------


def test_generation_config_defaults_read_the_sampling_keys(tmp_path) -> None:
    config = {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": None, "repetition_penalty": 1.05,
        "max_new_tokens": 512, "do_sample": True, "eos_token_id": [1, 2], "bos_token_id": 0,
    }  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_config_defaults(tmp_path)
    assert defaults == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_tokens": 512,
    }  # fmt: skip
    params = SamplingParams(top_k=5).with_defaults(defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 5, 512)
    overridden = generation_config_defaults(tmp_path, {"temperature": 0.1, "top_p": None})
    assert overridden["temperature"] == 0.1 and "top_p" not in overridden


def test_no_generation_config_means_no_defaults(tmp_path) -> None:
    assert generation_config_defaults(tmp_path) == {}
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert generation_config_defaults(gguf) == {}
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        generation_config_defaults(tmp_path)
