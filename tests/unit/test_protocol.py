"""The OpenAI-compatible request and response models: what they accept, what they reject (with the
field named in the error's loc), how a request becomes SamplingParams, and that the responses parse
with the official `openai` client's own types."""

import json
import math
import time
from typing import Any

import openai.types as oa
import openai.types.chat as oa_chat
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from tandem.outputs import Logprob
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestValidationError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeRequest,
)
from tandem.server.protocol_responses import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokenUsageInfo,
    UsageInfo,
    error_body,
)

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hello", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def rejection(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """The one validation error `body` gets (each test sends one mistake)."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = info.value.errors()
    assert len(errors) == 1, errors
    return errors[0]


# ------------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Hello", ["Hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([0], [[0]]),
    ],
)
def test_every_prompt_shape_normalises_to_a_list_of_prompts(prompt: Any, expected: list) -> None:
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        [],
        [""],
        ["a", ""],
        [[]],
        [[1], []],
        [1, "a"],
        [[1], "a"],
        [-1],
        [[1, -2]],
        [True],
        [1.0],
        5,
        None,
        {"text": "x"},
    ],
)
def test_bad_prompts_say_which_shapes_are_allowed(prompt: Any) -> None:
    error = rejection(CompletionRequest, {"prompt": prompt})
    assert error["loc"] == ("prompt",)
    assert error["msg"].startswith("`prompt` must be a non-empty string, a list of them")


def test_prompt_and_messages_are_required() -> None:
    assert rejection(CompletionRequest, {})["loc"] == ("prompt",)
    assert rejection(ChatCompletionRequest, {})["loc"] == ("messages",)


# ---------------------------------------------------------------------------- value checks

BAD_VALUES = [
    ("n", 0),
    ("n", 129),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", -math.inf),
    ("repetition_penalty", 0),
    ("repetition_penalty", math.inf),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("stop", ""),
    ("stop", ["\n", ""]),
    ("stop_token_ids", [-1]),
    ("min_tokens", -1),
    ("prompt_logprobs", -2),
    ("prompt_logprobs", 21),
    ("cache_salt", ""),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {"-5": 1.0}),
    ("logit_bias", {"5": math.nan}),
    ("allowed_token_ids", [-1]),
]


@pytest.mark.parametrize(("field", "value"), [*BAD_VALUES, ("logprobs", -1), ("logprobs", 21)])
def test_completion_values_out_of_range_name_the_field(field: str, value: Any) -> None:
    error = rejection(CompletionRequest, {"prompt": "x", field: value})
    assert error["loc"][0] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *BAD_VALUES,
        ("max_completion_tokens", 0),
        ("top_logprobs", -2),
        ("top_logprobs", 21),
    ],
)
def test_chat_values_out_of_range_name_the_field(field: str, value: Any) -> None:
    body = {"messages": USER, "logprobs": True, field: value}
    assert rejection(ChatCompletionRequest, body)["loc"][0] == field


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("n", 0, "greater than or equal to 1"),
        ("logprobs", 21, "less than or equal to 20"),
        ("top_p", 0, "greater than 0"),
        ("temperature", math.nan, "finite number"),
        ("stop", "", "`stop` must be a non-empty string or a list of them"),
    ],
)
def test_range_errors_say_what_is_allowed(field: str, value: Any, words: str) -> None:
    assert words in rejection(CompletionRequest, {"prompt": "x", field: value})["msg"]


def test_values_at_the_edges_are_accepted() -> None:
    request = completion(
        n=128,
        temperature=5.0,
        top_p=1,
        top_k=-1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=0.01,
        seed=-(2**63),
        logprobs=20,
        prompt_logprobs=0,
        stop=["a", "b", "c", "d", "e"],
        stop_token_ids=[0],
        max_tokens=1,
    )
    assert request.temperature == 5.0  # vLLM allows temperature above OpenAI's 2
    assert request.stop == ["a", "b", "c", "d", "e"]  # vLLM allows more than OpenAI's 4


def test_top_logprobs_needs_logprobs() -> None:
    error = rejection(ChatCompletionRequest, {"messages": USER, "top_logprobs": 3})
    assert error["loc"] == ("top_logprobs",)
    assert "`logprobs: true`" in error["msg"]
    assert chat(top_logprobs=0).top_logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).top_logprobs == 3


def test_request_id_must_be_valid_unicode() -> None:
    """It comes back in every chunk as UTF-8, which cannot carry the lone surrogate that JSON's
    escapes let in."""
    body = json.loads('{"prompt": "p", "request_id": "abc\\ud800"}')
    error = rejection(CompletionRequest, body)
    assert error["loc"] == ("request_id",)
    assert "unpaired surrogate" in error["msg"]
    chat_error = rejection(ChatCompletionRequest, {"messages": USER, "request_id": "\udfff"})
    assert chat_error["loc"] == ("request_id",)
    assert CompletionRequest(prompt="p", request_id="é-🤖").request_id == "é-🤖"


def test_stream_options_need_stream() -> None:
    error = rejection(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}})
    assert error["loc"] == ("stream_options",)
    request = completion(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert request.stream_options is not None
    assert request.stream_options.include_usage is True
    assert request.stream_options.continuous_usage_stats is True


def test_prompt_logprobs_are_not_streamed() -> None:
    error = rejection(CompletionRequest, {"prompt": "x", "stream": True, "prompt_logprobs": 1})
    assert error["loc"] == ("prompt_logprobs",)


# ----------------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("temperature", "hot"),
        ("temperature", "0.5"),
        ("n", 2.0),
        ("n", True),
        ("seed", "7"),
        ("logprobs", True),
        ("logprobs", "2"),
        ("stream", "true"),
        ("stream", 1),
        ("ignore_eos", 0),
        ("stop", 5),
        ("stop_token_ids", ["1"]),
        ("top_k", 1.5),
        ("user", 5),
    ],
)
def test_wrong_json_types_are_errors_not_coerced(field: str, value: Any) -> None:
    assert rejection(CompletionRequest, {"prompt": "x", field: value})["loc"][0] == field


def test_raw_json_is_strict_too() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json('{"prompt": "x", "max_tokens": "5"}')
    assert info.value.errors()[0]["loc"] == ("max_tokens",)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json(
            json.dumps({"messages": USER, "logprobs": "true"})
        )


def test_json_ints_are_accepted_for_floats() -> None:
    request = completion(temperature=1, top_p=1, presence_penalty=0)
    assert request.temperature == 1.0 and isinstance(request.temperature, float)


# ---------------------------------------------------------------------------- unknown fields


@pytest.mark.parametrize(
    ("model", "body", "loc"),
    [
        (CompletionRequest, {"prompt": "x", "temprature": 0.5}, ("temprature",)),
        (ChatCompletionRequest, {"messages": USER, "max_new_tokens": 5}, ("max_new_tokens",)),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x", "mood": "happy"}]},
            ("messages", 0, "mood"),
        ),
        (
            CompletionRequest,
            {"prompt": "x", "stream": True, "stream_options": {"usage": True}},
            ("stream_options", "usage"),
        ),
        (TokenizeCompletionRequest, {"prompt": "x", "foo": 1}, ("foo",)),
        (DetokenizeRequest, {"tokens": [1], "foo": 1}, ("foo",)),
    ],
)
def test_unknown_fields_are_rejected(model: type[BaseModel], body: dict, loc: tuple) -> None:
    error = rejection(model, body)
    assert error["loc"] == loc
    assert error["type"] == "extra_forbidden"


# ---------------------------------------------------------------- known but not supported yet

UNSUPPORTED_COMMON = [
    ("logits_processors", ["my.module.Processor"]),
    ("early_stopping", True),
    ("best_of", 3),
    ("guided_whitespace_pattern", "[ ]?"),
    ("structural_tag", "{}"),
    ("vllm_xargs", {"k": 1}),
    ("thinking_token_budget", 100),
]
UNSUPPORTED_CHAT = [
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {"search_context_size": "low"}),
]


@pytest.mark.parametrize(
    ("model", "field", "value"),
    [(CompletionRequest, f, v) for f, v in UNSUPPORTED_COMMON]
    + [(CompletionRequest, "suffix", "\n}"), (CompletionRequest, "prompt_embeds", "AAAA")]
    + [(ChatCompletionRequest, f, v) for f, v in UNSUPPORTED_COMMON + UNSUPPORTED_CHAT],
)
def test_known_but_unsupported_fields_are_rejected_when_set(
    model: type[BaseModel], field: str, value: Any
) -> None:
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": USER}
    error = rejection(model, {**body, field: value})
    assert error["loc"] == (field,)
    assert f"`{field}` is not supported by tandem yet" in error["msg"]


def test_unsupported_errors_say_what_to_send_instead() -> None:
    msg = rejection(ChatCompletionRequest, {"messages": USER, "early_stopping": True})["msg"]
    assert "omit it or send false" in msg
    msg = rejection(CompletionRequest, {"prompt": "x", "thinking_token_budget": 100})["msg"]
    assert "omit it or send null or -1" in msg
    assert "equal to `n`" in rejection(CompletionRequest, {"prompt": "x", "best_of": 2})["msg"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", None),
        ("logit_bias", {}),
        ("allowed_token_ids", None),
        ("bad_words", []),
        ("use_beam_search", False),
        ("length_penalty", 1.0),
        ("length_penalty", 1),
        ("spaces_between_special_tokens", True),
        ("return_tokens_as_token_ids", False),
        ("response_format", None),
        ("guided_json", None),
        ("truncate_prompt_tokens", None),
        ("truncation_side", "left"),
        ("thinking_token_budget", -1),
        # no effect on the output: accepted and ignored
        ("user", "alice"),
        ("request_id", "abc"),
        ("session_id", "s1"),
        ("stream_interval", 4),
    ],
)
def test_unsupported_fields_at_their_defaults_are_accepted(field: str, value: Any) -> None:
    assert getattr(completion(**{field: value}), field) == value
    assert getattr(chat(**{field: value}), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", []),
        ("tool_choice", "none"),
        ("function_call", "none"),
        ("modalities", ["text"]),
        ("echo", False),
        ("echo", True),
        ("include_reasoning", True),
        ("documents", None),
        ("metadata", {"k": "v"}),
        ("store", True),
        ("service_tier", "flex"),
        ("parallel_tool_calls", True),
        ("prompt_cache_key", "k"),
        ("safety_identifier", "id"),
        ("prediction", {"type": "content", "content": "draft"}),
    ],
)
def test_chat_fields_that_ask_for_nothing_missing_are_accepted(field: str, value: Any) -> None:
    assert getattr(chat(**{field: value}), field) == value


def test_truncation_side_and_token_ids_as_logprob_tokens_are_served() -> None:
    """The route honours them (serving.py): no longer refused as unsupported."""
    for make in (completion, chat):
        assert make(truncate_prompt_tokens=4, truncation_side="right").truncation_side == "right"
        assert make(return_tokens_as_token_ids=True).return_tokens_as_token_ids is True
    assert rejection(CompletionRequest, {"prompt": "x", "truncation_side": "middle"})["loc"] == (
        "truncation_side",
    )


def test_beam_search_settings_and_what_it_refuses() -> None:
    """use_beam_search takes vLLM's settings (n beams, length_penalty, ignore_eos, the fitted
    max_tokens and temperature); a field it cannot honour is a 400 naming it, unless its
    value asks for nothing."""
    request = completion(use_beam_search=True, n=3, length_penalty=0.5, ignore_eos=True)
    params = request.beam_search_params(SamplingParams(n=3, max_tokens=7, temperature=0.0))
    assert (params.beam_width, params.max_tokens, params.temperature) == (3, 7, 0.0)
    assert (params.length_penalty, params.ignore_eos) == (0.5, True)
    for field, value in (("top_p", 0.9), ("top_k", 5), ("seed", 0), ("stop", "x"),
                         ("stop_token_ids", [3]), ("repetition_penalty", 1.2),
                         ("logit_bias", {"3": 1.0}), ("min_tokens", 1),
                         ("logprob_token_ids", [3])):  # fmt: skip
        with pytest.raises(RequestValidationError, match="does not apply to beam search") as info:
            completion(use_beam_search=True, **{field: value}).beam_search_params(SamplingParams())
        assert info.value.param == field
    echoed = completion(use_beam_search=True, echo=True, logprobs=1)
    with pytest.raises(RequestValidationError, match="beam search does not compute") as info:
        echoed.beam_search_params(SamplingParams(prompt_logprobs=1))
    assert info.value.param == "echo"
    quiet = completion(use_beam_search=True, top_p=1.0, top_k=-1, stop=[], min_p=0)
    assert quiet.beam_search_params(SamplingParams()).beam_width == 1
    # each step asks for 2 * n logprobs, held to the server's max_logprobs
    wide = completion(use_beam_search=True, n=11)
    with pytest.raises(RequestValidationError, match=r"n <= 10, or start the server") as info:
        wide.beam_search_params(SamplingParams(n=11), max_logprobs=20)
    assert info.value.param == "n"
    assert wide.beam_search_params(SamplingParams(n=11), max_logprobs=-1).beam_width == 11


def test_best_of_equal_to_n_is_accepted() -> None:
    assert completion(n=3, best_of=3).best_of == 3


def test_unsupported_message_fields_are_rejected() -> None:
    call = {"name": "f", "arguments": "{}"}  # OpenAI's older function calling
    error = rejection(
        ChatCompletionRequest,
        {"messages": [{"role": "assistant", "content": None, "function_call": call}]},
    )
    assert error["loc"] == ("messages", 0, "function_call")
    assert "not supported by tandem yet" in error["msg"]


# ------------------------------------------------------------------------------ chat messages


def test_text_parts_are_joined_and_developer_becomes_system() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "name": "ann",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                {"role": "system", "content": []},
            ]
        }
    )
    assert request.messages[1].text == "a\nb"
    assert request.conversation() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "system", "content": ""},
    ]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
        {"type": "video_url", "video_url": {"url": "x"}},
        {"image_url": {"url": "x"}},
        "just a string",
    ],
)
def test_non_text_content_parts_are_a_clear_error(part: Any) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    error = rejection(ChatCompletionRequest, {"messages": [{"role": "user", "content": content}]})
    assert error["loc"] == ("messages", 0, "content")
    assert "tandem serves text-only models" in error["msg"]


@pytest.mark.parametrize(
    ("messages", "loc", "words"),
    [
        ([], ("messages",), "at least one message"),
        ([{"role": "user"}], ("messages", 0, "content"), "required for user messages"),
        ([{"role": "user", "content": None}], ("messages", 0, "content"), "required"),
        ([{"role": "function", "content": "x"}], ("messages", 0, "role"), "'developer'"),
        ([{"role": "user", "content": 5}], ("messages", 0, "content"), ""),
        ("Hi", ("messages",), ""),
    ],
)
def test_bad_messages_name_the_message_and_field(messages: Any, loc: tuple, words: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": messages})
    error = info.value.errors()[0]
    assert error["loc"][: len(loc)] == loc
    assert words in error["msg"]


def test_continue_final_message_needs_add_generation_prompt_off() -> None:
    error = rejection(ChatCompletionRequest, {"messages": USER, "continue_final_message": True})
    assert error["loc"] == ("continue_final_message",)
    assert "`add_generation_prompt: false`" in error["msg"]
    request = chat(continue_final_message=True, add_generation_prompt=False)
    assert request.continue_final_message and not request.add_generation_prompt


def test_chat_template_fields_are_kept_for_the_route() -> None:
    request = chat(chat_template="{{ messages }}", chat_template_kwargs={"enable_thinking": False})
    assert request.chat_template == "{{ messages }}"
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert request.add_generation_prompt is True
    assert request.add_special_tokens is False  # the template adds BOS, as in vLLM
    assert completion().add_special_tokens is True


# -------------------------------------------------------------------------- to_sampling_params


def test_completion_maps_every_sampling_field() -> None:
    request = completion(
        n=2,
        best_of=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        max_tokens=50,
        min_tokens=3,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 8],
        ignore_eos=True,
        logprobs=5,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        prompt_logprobs=2,
        spaces_between_special_tokens=False,
        logit_bias={"50256": -100, "7": 2.5},
        allowed_token_ids=[7, 8, 9],
        bad_words=["darn", "heck"],
        truncate_prompt_tokens=12,
    )
    params = request.to_sampling_params(default_max_tokens=1000)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (2, 0.7, 0.9, 40)
    assert (params.min_p, params.seed, params.max_tokens, params.min_tokens) == (0.05, 1234, 50, 3)
    assert params.stop == ["\n\n", "END"]
    assert params.stop_token_ids == [7, 8]
    assert params.ignore_eos is True
    assert params.logprobs == 5
    assert params.prompt_logprobs == 2
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.1
    assert params.skip_special_tokens is False
    assert params.include_stop_str_in_output is True
    assert params.spaces_between_special_tokens is False
    assert params.logit_bias == {50256: -100.0, 7: 2.5}  # OpenAI's string keys become ids
    assert params.allowed_token_ids == [7, 8, 9]
    assert params.bad_words == ["darn", "heck"]
    assert params.truncate_prompt_tokens == 12


def test_chat_maps_the_vllm_sampling_extras() -> None:
    request = chat(logit_bias={"3": 1}, allowed_token_ids=[3], bad_words=["x"],
                   spaces_between_special_tokens=False, truncate_prompt_tokens=-1)  # fmt: skip
    params = request.to_sampling_params(100)
    assert (params.logit_bias, params.allowed_token_ids, params.bad_words) == ({3: 1.0}, [3], ["x"])
    assert (params.spaces_between_special_tokens, params.truncate_prompt_tokens) == (False, -1)


def test_logit_bias_is_clamped_as_vllm_does() -> None:
    params = completion(logit_bias={"1": 500, "2": -1e6}).to_sampling_params(100)
    assert params.logit_bias == {1: 100.0, 2: -100.0}


def test_logit_bias_keys_must_be_token_ids() -> None:
    error = rejection(CompletionRequest, {"prompt": "x", "logit_bias": {"a1": 2}})
    assert error["loc"] == ("logit_bias",)
    assert "keys must be token ids" in error["msg"] and '"a1"' in error["msg"]


def test_minus_one_logprobs_ask_for_the_vocabulary_and_meet_the_limit() -> None:
    """vLLM takes -1 for top_logprobs and prompt_logprobs (not for completions' logprobs) and
    holds the whole vocabulary to --max-logprobs, 20 by default: refused, naming the field."""
    request = chat(logprobs=True, top_logprobs=-1)
    assert request.to_sampling_params(100).logprobs == -1  # no vocabulary given: passes on
    assert request.to_sampling_params(100, vocab_size=20).logprobs == -1
    with pytest.raises(RequestValidationError) as info:
        request.to_sampling_params(100, vocab_size=49152)
    assert info.value.param == "top_logprobs"
    assert "all 49152 tokens" in info.value.message and "max_logprobs of 20" in info.value.message
    unlimited = request.to_sampling_params(100, vocab_size=49152, max_logprobs=-1)
    assert unlimited.logprobs == -1
    for request in (completion(prompt_logprobs=-1), chat(prompt_logprobs=-1)):
        with pytest.raises(RequestValidationError) as info:
            request.to_sampling_params(100, vocab_size=49152)
        assert info.value.param == "prompt_logprobs"
    assert rejection(CompletionRequest, {"prompt": "x", "logprobs": -1})["loc"] == ("logprobs",)


def test_generation_config_defaults_fill_the_null_fields() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                "repetition_penalty": 1.1, "max_tokens": 64}  # fmt: skip
    for request in (completion(), chat()):
        params = request.to_sampling_params(1000, defaults=defaults)
        assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
        assert (params.min_p, params.repetition_penalty) == (0.05, 1.1)
    explicit = chat(temperature=1.0, top_k=-1, max_tokens=500)
    params = explicit.to_sampling_params(1000, defaults=defaults)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, -1, 0.9)
    assert params.max_tokens == 500
    # chat without max_tokens stops at max_new_tokens, or at the room left if that is less
    assert chat().to_sampling_params(1000, defaults=defaults).max_tokens == 64
    assert chat().to_sampling_params(30, defaults=defaults).max_tokens == 30
    # completions keep their default of 16
    assert completion().to_sampling_params(1000, defaults=defaults).max_tokens == 16


def test_defaults_match_vllm_without_a_generation_config() -> None:
    for request in (completion(), chat()):
        params = request.to_sampling_params(default_max_tokens=1000)
        assert params.n == 1
        assert params.temperature == 1.0
        assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
        assert params.seed is None
        assert (params.stop, params.stop_token_ids) == ([], [])
        assert params.logprobs is None
        assert params.prompt_logprobs is None
        assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
        assert params.repetition_penalty == 1.0
        assert params.skip_special_tokens is True
        assert params.include_stop_str_in_output is False
        assert params.min_tokens == 0


def test_nulls_mean_the_defaults() -> None:
    nulls = dict.fromkeys(
        [
            "n",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ]
    )
    assert completion(**nulls).to_sampling_params(100) == completion().to_sampling_params(100)
    assert chat(**nulls).to_sampling_params(100) == chat().to_sampling_params(100)


def test_completion_max_tokens_defaults_to_16() -> None:
    assert completion().to_sampling_params(default_max_tokens=1000).max_tokens == 16
    assert completion(max_tokens=None).to_sampling_params(1000).max_tokens == 16
    assert completion(max_tokens=300).to_sampling_params(1000).max_tokens == 300
    # the default shrinks to what the context has left; an explicit ask does not
    assert completion().to_sampling_params(default_max_tokens=10).max_tokens == 10


def test_chat_max_tokens_defaults_to_filling_the_context() -> None:
    assert chat().to_sampling_params(default_max_tokens=777).max_tokens == 777
    assert chat(max_tokens=20).to_sampling_params(777).max_tokens == 20
    assert chat(max_completion_tokens=30).to_sampling_params(777).max_tokens == 30
    assert chat(max_tokens=20, max_completion_tokens=30).to_sampling_params(777).max_tokens == 30


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (completion(max_tokens=101), "max_tokens"),
        (chat(max_tokens=101), "max_tokens"),
        (chat(max_tokens=5, max_completion_tokens=101), "max_completion_tokens"),
    ],
)
def test_asking_past_the_context_names_the_field(request_: Any, param: str) -> None:
    with pytest.raises(RequestValidationError) as info:
        request_.to_sampling_params(default_max_tokens=100)
    assert info.value.param == param
    assert "at most 100" in str(info.value)
    assert request_.to_sampling_params(default_max_tokens=101).max_tokens == 101


@pytest.mark.parametrize(("request_", "param"), [(completion(), "prompt"), (chat(), "messages")])
def test_a_prompt_that_fills_the_context_is_an_error(request_: Any, param: str) -> None:
    for room in (0, -3):
        with pytest.raises(RequestValidationError) as info:
            request_.to_sampling_params(default_max_tokens=room)
        assert info.value.param == param


def test_sampling_params_errors_become_request_errors_naming_the_field() -> None:
    with pytest.raises(RequestValidationError) as info:
        completion(min_tokens=20, max_tokens=10).to_sampling_params(1000)
    assert info.value.param == "min_tokens"
    assert isinstance(info.value, ValueError)
    assert "min_tokens must be <= max_tokens" in info.value.message
    with pytest.raises(RequestValidationError) as info:
        chat(min_tokens=20, max_completion_tokens=10).to_sampling_params(1000)
    assert info.value.param == "min_tokens"


def test_completion_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert completion(echo=True, logprobs=3).to_sampling_params(100).prompt_logprobs == 3
    assert completion(echo=True, logprobs=0).to_sampling_params(100).prompt_logprobs == 0
    assert completion(echo=True).to_sampling_params(100).prompt_logprobs is None
    assert completion(logprobs=3).to_sampling_params(100).prompt_logprobs is None
    explicit = completion(echo=True, logprobs=3, prompt_logprobs=1)
    assert explicit.to_sampling_params(100).prompt_logprobs == 1


def test_chat_logprobs_flag_and_top_logprobs() -> None:
    assert chat().to_sampling_params(100).logprobs is None
    assert chat(logprobs=False).to_sampling_params(100).logprobs is None
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0
    assert chat(logprobs=True, top_logprobs=None).to_sampling_params(100).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).to_sampling_params(100).logprobs == 5
    assert chat(prompt_logprobs=2).to_sampling_params(100).prompt_logprobs == 2


# -------------------------------------------------------------------------- tokenize requests


def test_tokenize_request_is_told_apart_by_messages() -> None:
    adapter = TypeAdapter(TokenizeRequest)
    plain = adapter.validate_python({"prompt": "Hello", "return_token_strs": True})
    assert isinstance(plain, TokenizeCompletionRequest)
    assert plain.add_special_tokens is True and plain.return_token_strs is True
    conversation = adapter.validate_python({"messages": USER})
    assert isinstance(conversation, TokenizeChatRequest)
    assert conversation.conversation() == [{"role": "user", "content": "Hi"}]
    assert conversation.add_special_tokens is False
    with pytest.raises(ValidationError) as info:
        adapter.validate_python({"messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert info.value.errors()[0]["loc"] == ("chat", "messages", 0, "content")


def test_detokenize_takes_token_ids_only() -> None:
    assert DetokenizeRequest.model_validate({"tokens": [1, 2]}).tokens == [1, 2]
    for tokens in ([-1], ["1"], [1.0], "1 2"):
        assert rejection(DetokenizeRequest, {"tokens": tokens})["loc"][0] == "tokens"


def test_request_schemas_build_for_the_openapi_page() -> None:
    for model in (CompletionRequest, ChatCompletionRequest, DetokenizeRequest):
        schema = model.model_json_schema()
        assert schema["additionalProperties"] is False
    assert "oneOf" in json.dumps(TypeAdapter(TokenizeRequest).json_schema())


# ------------------------------------------------------------------------------- responses


def as_json(model: BaseModel) -> dict[str, Any]:
    return json.loads(model.model_dump_json())


def test_chat_completion_parses_with_the_openai_client() -> None:
    top = [ChatCompletionLogProb(token="Hi", logprob=-0.1, bytes=[72, 105])]
    logprobs = ChatCompletionLogProbs(
        content=[ChatCompletionLogProbsContent(token="Hi", logprob=-0.1, top_logprobs=top)]
    )
    response = ChatCompletionResponse(
        model="smollm2",
        choices=[
            ChatCompletionResponseChoice(
                index=0,
                message=ChatMessage(content="Hi"),
                logprobs=logprobs,
                finish_reason="length",
            )
        ],
        usage=UsageInfo(
            prompt_tokens=7,
            completion_tokens=1,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=4),
        ),
    )
    parsed = oa_chat.ChatCompletion.model_validate(as_json(response))
    assert parsed.id.startswith("chatcmpl-")
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].finish_reason == "length"
    assert parsed.choices[0].logprobs is not None
    content = parsed.choices[0].logprobs.content
    assert content is not None and content[0].top_logprobs[0].bytes == [72, 105]
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.total_tokens) == (7, 8)
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4


def test_completion_parses_with_the_openai_client() -> None:
    logprobs = CompletionLogProbs(
        tokens=[" a", " b"],
        token_logprobs=[-0.5, -1.5],
        top_logprobs=[{" a": -0.5}, {" b": -1.5, " c": -2.0}],
        text_offset=[5, 7],
    )
    response = CompletionResponse(
        model="smollm2",
        choices=[
            CompletionResponseChoice(
                index=0, text=" a b", logprobs=logprobs, finish_reason="stop", stop_reason="\n"
            )
        ],
        usage=UsageInfo(prompt_tokens=3, completion_tokens=2),
    )
    body = as_json(response)
    parsed = oa.Completion.model_validate(body)
    assert parsed.id.startswith("cmpl-")
    assert parsed.object == "text_completion"
    assert parsed.created == response.created
    assert parsed.choices[0].text == " a b"
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.top_logprobs == [{" a": -0.5}, {" b": -1.5, " c": -2.0}]
    assert parsed.choices[0].logprobs.text_offset == [5, 7]
    assert parsed.usage is not None and parsed.usage.total_tokens == 5
    assert body["choices"][0]["stop_reason"] == "\n"  # vLLM's addition rides along


def test_stream_chunks_parse_with_the_openai_client() -> None:
    chunk = ChatCompletionStreamResponse(
        model="m",
        choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant"))],
    )
    parsed = oa_chat.ChatCompletionChunk.model_validate(as_json(chunk))
    assert parsed.object == "chat.completion.chunk"
    assert parsed.choices[0].delta.role == "assistant"
    last = ChatCompletionStreamResponse(
        id=chunk.id, model="m", choices=[], usage=UsageInfo(prompt_tokens=2, completion_tokens=3)
    )
    parsed_last = oa_chat.ChatCompletionChunk.model_validate(as_json(last))
    assert parsed_last.usage is not None and parsed_last.usage.total_tokens == 5
    text_chunk = CompletionStreamResponse(
        model="m",
        choices=[CompletionResponseStreamChoice(index=0, text="x", finish_reason="length")],
    )
    assert oa.Completion.model_validate(as_json(text_chunk)).choices[0].text == "x"


def test_ids_are_unique_and_created_is_unix_time() -> None:
    first = ChatCompletionResponse(model="m", choices=[], usage=UsageInfo())
    second = ChatCompletionResponse(model="m", choices=[], usage=UsageInfo())
    assert first.id != second.id
    assert abs(first.created - time.time()) < 5


def test_minus_infinity_logprobs_serialise_as_numbers() -> None:
    logprob = ChatCompletionLogProb(token="x", logprob=-math.inf)
    assert as_json(logprob)["logprob"] == -9999.0
    completion_logprobs = CompletionLogProbs(
        tokens=["x", "y"], token_logprobs=[None, -math.inf], top_logprobs=[None, {"y": math.nan}]
    )
    body = as_json(completion_logprobs)
    assert body["token_logprobs"] == [None, -9999.0]
    assert body["top_logprobs"] == [None, {"y": -9999.0}]


def test_prompt_logprobs_take_the_engines_logprob_objects() -> None:
    choice = CompletionResponseChoice(
        index=0,
        text="",
        prompt_logprobs=[None, {5: Logprob(logprob=-1.25, rank=2, decoded_token=" b")}],
        prompt_token_ids=[1, 5],
    )
    body = as_json(choice)
    assert body["prompt_logprobs"] == [
        None,
        {"5": {"logprob": -1.25, "rank": 2, "decoded_token": " b"}},
    ]
    assert body["prompt_token_ids"] == [1, 5]


def test_model_list_parses_with_the_openai_client() -> None:
    models = ModelList(data=[ModelCard(id="smollm2", root="/models/smollm2", max_model_len=8192)])
    body = as_json(models)
    assert body["object"] == "list"
    parsed = oa.Model.model_validate(body["data"][0])
    assert (parsed.id, parsed.object, parsed.owned_by) == ("smollm2", "model", "tandem")
    assert body["data"][0]["max_model_len"] == 8192


def test_error_body_has_openais_shape() -> None:
    body = error_body("`top_p` must be in (0, 1]", param="top_p", code=400)
    assert body == {
        "error": {
            "message": "`top_p` must be in (0, 1]",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": 400,
        }
    }
    assert ErrorResponse.model_validate(body).error.param == "top_p"
    assert error_body("boom", "internal_error")["error"]["param"] is None


# -------------------------------------------------------------------------------------- tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tool_choice_defaults_as_vllms() -> None:
    assert chat().effective_tool_choice == "none"
    assert chat(tools=[WEATHER_TOOL]).effective_tool_choice == "auto"
    assert chat(tools=[WEATHER_TOOL], tool_choice="none").effective_tool_choice == "none"
    assert chat(tools=[], tool_choice="required").effective_tool_choice == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER_TOOL], tool_choice=named).effective_tool_choice.function.name == (
        "get_weather"
    )


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, '"none", "auto", "required"'),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"function": {"nam": "x"}}}, "a named function"),
        ({"tools": [WEATHER_TOOL], "tool_choice": 5}, '"none", "auto", "required"'),
        ({"tool_choice": "auto"}, "needs `tools`"),
        ({"tool_choice": "required"}, "needs `tools`"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"function": {"name": "x"}}},
            "not among `tools`",
        ),
    ],
)
def test_bad_tool_choices_say_what_is_allowed(fields: dict, words: str) -> None:
    error = rejection(ChatCompletionRequest, {"messages": USER, **fields})
    assert error["loc"] == ("tool_choice",)
    assert words in error["msg"]


@pytest.mark.parametrize(
    ("tool", "loc"),
    [
        ({"type": "function", "function": {"name": ""}}, ("tools", 0, "function", "name")),
        ({"type": "function"}, ("tools", 0, "function")),
        ({"type": "code_interpreter", "function": {"name": "f"}}, ("tools", 0, "type")),
        ({"type": "function", "function": {"name": "f", "extra": 1}},
         ("tools", 0, "function", "extra")),
    ],
)  # fmt: skip
def test_malformed_tools_name_the_field(tool: dict, loc: tuple) -> None:
    assert rejection(ChatCompletionRequest, {"messages": USER, "tools": [tool]})["loc"] == loc


def history(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
    ]


def test_tool_calls_in_the_history_reach_the_template_with_object_arguments() -> None:
    """As vLLM passes them: each call's arguments parsed into an object, so that templates can
    write them with tojson; the tools in OpenAI's shape."""
    request = chat(messages=history('{"city": "Paris"}'), tools=[WEATHER_TOOL])
    turns = request.conversation()
    assert turns[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }  # fmt: skip
    assert turns[2] == {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"}
    assert request.template_tools() == [WEATHER_TOOL]
    empty = chat(messages=history("")).conversation()[1]["tool_calls"][0]["function"]
    assert empty["arguments"] == {}


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]", '"text"'])
def test_history_arguments_must_be_a_json_object(arguments: str) -> None:
    error = rejection(ChatCompletionRequest, {"messages": history(arguments)})
    assert error["loc"] == ("messages", 1, "tool_calls", 0, "function", "arguments")
    assert "JSON object" in error["msg"]


# -------------------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
NAMED_SCHEMA = {"name": "x", "schema": SCHEMA}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": NAMED_SCHEMA}},
         StructuredOutputsParams(json=SCHEMA)),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         StructuredOutputsParams(json_object=True)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
         StructuredOutputsParams(json=SCHEMA)),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"response_format": {"type": "text"}}, None),
    ],
)  # fmt: skip
def test_every_structured_outputs_field_reaches_the_sampling_params(fields, expected) -> None:
    for request in (completion(**fields), chat(**fields)):
        assert request.to_sampling_params(100).structured_outputs == expected


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format",
         "each ask for structured outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "exactly one"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "no field 'pattern'"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs", "must be a string"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs",
         "not supported"),
    ],
)  # fmt: skip
def test_structured_outputs_errors_name_the_field(fields: dict, param: str, words: str) -> None:
    with pytest.raises(RequestValidationError, match=words) as error:
        chat(**fields).to_sampling_params(100)
    assert error.value.param == param


@pytest.mark.parametrize(
    "response_format",
    [{"type": "xml"}, {"type": "json_schema"}, {"type": "text", "json_schema": {"schema": {}}},
     {"type": "json_schema", "json_schema": {"schema": SCHEMA, "extra": 1}}],
)  # fmt: skip
def test_malformed_response_formats_are_400s(response_format: dict) -> None:
    error = rejection(ChatCompletionRequest, {"messages": USER, "response_format": response_format})
    assert error["loc"][0] == "response_format"
