import math

import pytest

from tandem.sampling_params import SamplingParams


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
    assert params.ignore_eos is False
    assert params.logprobs is None
    assert params.prompt_logprobs is None
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.skip_special_tokens is True
    assert params.include_stop_str_in_output is False


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_stop_lists_are_copied() -> None:
    stop, stop_token_ids = ["x"], [5]
    params = SamplingParams(stop=stop, stop_token_ids=stop_token_ids)
    stop.append("y")
    stop_token_ids.append(6)
    assert params.stop == ["x"]
    assert params.stop_token_ids == [5]


def test_unlimited_max_tokens_is_allowed() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


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
        ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"max_tokens": True}, "max_tokens must be >= 1 or None, got True"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of token ids >= 0, got -1"),
        ({"logprobs": -1}, "logprobs must be >= 0 or None, got -1"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0 or None, got -1"),
        ({"prompt_logprobs": True}, "prompt_logprobs must be >= 0 or None, got True"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs must be >= 0 or None, got 2.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
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
        {"prompt_logprobs": 0},
        {"prompt_logprobs": 20},
        {"seed": 0},
        {"min_tokens": 16, "max_tokens": 16},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


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
