"""The OpenAI-compatible API's request bodies, as pydantic models (responses and the error body:
protocol_responses.py).

Requests mirror OpenAI's schema plus the extra fields vLLM accepts, so clients written for either
work unchanged, and they are strict: an unknown field, a string where a number belongs, a value
out of range or a field tandem cannot honour yet fails validation with the error's `loc` naming
the field, which the server turns into an OpenAI-shaped 400. Nothing a client asks for is
silently dropped, except fields that cannot change the output (`user`, `metadata`, ...).

Fields the route itself must honour (they are not sampling settings): `stream`, `stream_options`,
`echo`, `add_special_tokens`, the chat template fields (`chat_template`, `chat_template_kwargs`,
`add_generation_prompt`, `continue_final_message`, `documents`, `tools`), tool calling
(`tool_choice`, `parallel_tool_calls`: server/tool_parsers.py), `cache_salt`, `request_id`,
`return_token_ids`, `return_tokens_as_token_ids`, and `truncate_prompt_tokens` with
`truncation_side` (the prompt is cut before max_tokens is fitted to the room it leaves).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from tandem.beam_search import BeamSearchParams
from tandem.inputs import tool_call_arguments
from tandem.sampling_params import SamplingParams, StructuredOutputsParams

# OpenAI's documented limits; vLLM's default max_logprobs is the same 20. vLLM takes -1 (the
# whole vocabulary) for top_logprobs and prompt_logprobs, and holds it to that limit too.
MAX_LOGPROBS = 20
MAX_N = 128
# Completions default to 16 new tokens when max_tokens is absent or null (OpenAI and vLLM).
COMPLETION_DEFAULT_MAX_TOKENS = 16
_INT64 = 2**63

TokenId = Annotated[int, Field(ge=0)]


class RequestValidationError(ValueError):
    """A request that passed the schema but cannot be served as asked; `param` names the field
    (None when no single field is to blame), for the server's 400 body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# ------------------------------------------------------------------------------ request basics


def _not_supported(field: str, hint: str) -> PydanticCustomError:
    # No context: the message is final, so braces in `hint` are not read as placeholders.
    return PydanticCustomError("not_supported", f"`{field}` is not supported by tandem yet; {hint}")


# Fields tandem accepts but cannot honour yet: any value but their default is an error. One list
# for every request model, so the rule is written once.
# fmt: off
_UNSUPPORTED = (
    # sampling and decoding
    "logits_processors", "early_stopping", "watermarking", "repetition_detection",
    "thinking_token_budget",
    # structured outputs: outlines' whitespace pattern and structural tags
    "guided_whitespace_pattern", "structural_tag",
    # disaggregation and extensions
    "ec_transfer_params", "vllm_xargs",
    # completions
    "suffix", "prompt_embeds",
    # chat: OpenAI's older function calling, media, reasoning, OpenAI-hosted features
    "functions", "function_call", "audio", "refusal",
    "modalities", "moderation", "web_search_options", "verbosity", "reasoning_effort",
    "mm_processor_kwargs", "media_io_kwargs",
    "return_prompt_text",
)
# fmt: on
TOOL_CHOICES = ("none", "auto", "required")
# Non-default values that still ask for nothing tandem lacks.
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "function_call": ("none",),
    "modalities": (["text"],),
    "thinking_token_budget": (-1,),
}


def _asks_for_nothing(value: Any, no_ops: tuple[Any, ...]) -> bool:
    """Whether a field's value leaves it off: null, empty, or one of `no_ops`."""
    empty = isinstance(value, (str, list, dict)) and not value
    return value is None or empty or value in no_ops


class _Request(BaseModel):
    """Strict: "5" is not 5 and true is not 1, as in OpenAI's API; unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator(*_UNSUPPORTED, check_fields=False)
    @classmethod
    def _reject_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        assert name is not None
        no_ops = (cls.model_fields[name].default, *_NO_OP_VALUES.get(name, ()))
        if _asks_for_nothing(value, no_ops) or (value is False and no_ops[0] is None):
            return value  # null, an off flag or an empty list asks for nothing
        allowed = " or ".join(dict.fromkeys(map(json.dumps, no_ops)))
        raise _not_supported(name, f"omit it or send {allowed}")


class StreamOptions(_Request):
    include_usage: bool | None = False  # a last chunk with the usage and no choices
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; no effect


# ---------------------------------------------------------------------------------- chat input


class TextContentPart(_Request):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None  # OpenAI caching hint; no effect


class FunctionDefinition(_Request):
    """A tool the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # OpenAI's schema-adherence flag: no effect (a reply is held to the schema for tool_choice
    # "required" or naming the function, whatever it says, and otherwise not)
    strict: bool | None = None


class ChatCompletionToolParam(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCallParam(_Request):
    """A call the assistant made, as a conversation's history carries it back."""

    name: str
    arguments: str  # a JSON object; "" for none

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            tool_call_arguments(value)
        except ValueError:
            raise PydanticCustomError(
                "arguments", "a tool call's `arguments` must be a JSON object, as a string"
            ) from None
        return value


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionMessageParam(_Request):
    """One message; content is a string or text parts (joined with newlines, as vLLM does)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # tool messages: which call this answers
    tool_calls: list[ToolCallParam] | None = None  # assistant messages: the calls it made
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("role", "assistant") != "assistant":
            raise PydanticCustomError(
                "missing_content", "`content` is required for {role} messages", info.data
            )
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "text_only",
                    "tandem serves text-only models: content parts must be "
                    '{"type": "text", "text": ...}, got type ' + json.dumps(kind),
                )
        return value

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class _ChatPrompt(_Request):
    """A conversation and how the chat template renders it (chat and tokenize requests)."""

    messages: list[ChatCompletionMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open for the model to extend
    add_special_tokens: bool = False  # on top of what the template adds
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # for templates that render them (RAG)
    tools: list[ChatCompletionToolParam] | None = None  # rendered by the chat template
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, value: list[ChatCompletionMessageParam]) -> Any:
        if not value:
            raise PydanticCustomError("empty", "`messages` must hold at least one message")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _one_open_end(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise PydanticCustomError(
                "conflict",
                "`continue_final_message` needs `add_generation_prompt: false`: the model "
                "cannot both continue the last message and start a new one",
            )
        return value

    def conversation(self) -> list[dict[str, str]]:
        """The messages as `apply_chat_template` takes them. `developer` (OpenAI's newer name
        for the system role) becomes `system`, which the open models' templates know."""
        turns = []
        for message in self.messages:
            turn = {"role": "system" if message.role == "developer" else message.role}
            turn["content"] = message.text
            if message.name is not None:
                turn["name"] = message.name
            if message.tool_call_id is not None:
                turn["tool_call_id"] = message.tool_call_id
            if message.tool_calls:
                turn["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": call.type,
                        "function": {
                            "name": call.function.name,
                            "arguments": tool_call_arguments(call.function.arguments),
                        },
                    }
                    for call in message.tool_calls
                ]
            turns.append(turn)
        return turns

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape), None without any."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


# ----------------------------------------------------------------------------- generation input


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_logprobs_limit(
    param: str, value: int | None, vocab_size: int | None, max_logprobs: int
) -> None:
    """-1 asks for every token of the vocabulary: held to the server's --max-logprobs (20 by
    default, so -1 is refused unless it is raised; -1 there means no limit), as in vLLM."""
    if value == -1 and vocab_size is not None and -1 < max_logprobs < vocab_size:
        raise RequestValidationError(
            f"`{param}` of -1 asks for the logprobs of all {vocab_size} tokens, more than this "
            f"server's max_logprobs of {max_logprobs}; ask for at most {max_logprobs}, or "
            "start the server with --max-logprobs -1",
            param=param,
        )


def _fit_max_tokens(
    param: str, requested: int | None, fallback: int, room: int, prompt_param: str
) -> int:
    """`room` is max_model_len minus the prompt length. Asking past it is an error, as in OpenAI
    and vLLM; a default that does not fit shrinks to it."""
    if room < 1:
        raise RequestValidationError(
            "the prompt fills the model's whole context, leaving no room for output; shorten it",
            param=prompt_param,
        )
    if requested is None:
        return min(fallback, room)
    if requested > room:
        raise RequestValidationError(
            f"`{param}` is {requested}, but only {room} tokens of the model's context are left "
            f"after the prompt; ask for at most {room} or shorten the prompt",
            param=param,
        )
    return requested


class JsonSchemaFormat(_Request):
    name: str = "schema"
    description: str | None = None
    # OpenAI's key is `schema` (a pydantic name of its own): both spellings are taken
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # tandem always holds the output to the schema

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class ResponseFormat(_Request):
    """OpenAI's response_format: "text" (the default), "json_object" (any JSON object) or
    "json_schema" (output held to its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _with_its_type(
        cls, value: JsonSchemaFormat | None, info: ValidationInfo
    ) -> JsonSchemaFormat | None:
        if (value is None) == (info.data.get("type") == "json_schema"):
            raise PydanticCustomError(
                "response_format", '`json_schema` goes with type "json_schema", and only there'
            )
        return value


class _Generation(_Request):
    """Fields /v1/completions and /v1/chat/completions share, and their mapping to
    SamplingParams. null means the default wherever OpenAI allows null."""

    model: str | None = None  # the served model's name; the route checks it
    n: int | None = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1)  # must follow n: its check reads n
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)  # vLLM allows > 2
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    # vLLM's sampling extras
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    # -1: the whole vocabulary, which the server's limit (MAX_LOGPROBS) refuses, as vLLM's does
    prompt_logprobs: int | None = Field(None, ge=-1, le=MAX_LOGPROBS)
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None  # OpenAI
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k; -1: max_model_len
    # which end truncate_prompt_tokens cuts: "right" keeps the first k tokens (null: "left")
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    request_id: str | None = None
    return_token_ids: bool | None = False  # token_ids / prompt_token_ids in the response
    # logprobs' tokens as "token_id:{id}" (also the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    priority: int = 0  # lower first; needs the server's --scheduling-policy priority (vLLM's)
    # with logprobs: these tokens' logprobs at every output token, in place of the top-N (vLLM's)
    logprob_token_ids: list[TokenId] | None = None
    # vLLM's beam search: the n best of n beams; score = cum logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # accepted, no effect on the output
    user: str | None = None
    session_id: str | None = None
    stream_interval: int | None = Field(None, ge=1)  # how many tokens each chunk batches
    return_token_offsets: bool | None = False  # vLLM's render endpoints only
    return_mm_kwargs: bool = True  # vLLM's render endpoints only
    routed_experts_prompt_start: int = Field(0, ge=0)  # MoE routing data, never returned here
    # accepted so that asking for them is a clear error (see _UNSUPPORTED)
    logits_processors: list[Any] | None = None
    early_stopping: bool | str = False
    watermarking: bool | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (its fields as
    # StructuredOutputsParams has them) or its older guided_* fields, one of them at a time
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, no effect: xgrammar is the one
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None

    @field_validator("request_id")
    @classmethod
    def _check_request_id(cls, value: str | None) -> str | None:
        """Every chunk echoes it back as UTF-8: JSON lets a lone surrogate in, UTF-8 cannot
        carry one out."""
        if value is not None:
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ValueError(
                    "request_id has an unpaired surrogate (\\ud800-\\udfff escape): send "
                    "valid Unicode text"
                ) from None
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value != _or(info.data.get("n"), 1):
            raise _not_supported("best_of", "omit it or set it equal to `n`")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        strings = [value] if isinstance(value, str) else value
        if value is not None and not (
            isinstance(strings, list) and all(isinstance(s, str) and s for s in strings)
        ):
            raise PydanticCustomError(
                "stop_shape", "`stop` must be a non-empty string or a list of them"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI sends token ids as the keys' strings."""
        for key in value or ():
            if not key.isascii() or not key.isdigit():
                raise PydanticCustomError(
                    "token_id_key",
                    "`logit_bias` keys must be token ids (integers >= 0, as strings), got "
                    + json.dumps(key),
                )
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise PydanticCustomError(
                "truncate_zero",
                "`truncate_prompt_tokens` must be >= 1 (keep that many last prompt tokens) "
                "or -1 (keep max_model_len)",
            )
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError(
                "stream_only", "`stream_options` is only allowed with `stream: true`"
            )
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise PydanticCustomError(
                "stream_conflict", "`prompt_logprobs` is not available with `stream: true`"
            )
        return value

    def _sampling_params(
        self,
        *,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None,
        renames: dict[str, str],
        defaults: Mapping[str, Any] | None,
        vocab_size: int | None,
        max_logprobs: int,
    ) -> SamplingParams:
        """`renames` maps a SamplingParams field to the request field it came from, so an
        error names what the client sent. `defaults`: the model's generation-config defaults
        (generation_config_defaults), for the fields the request leaves null, as in vLLM."""
        defaults = defaults or {}
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            _check_logprobs_limit(renames.get(name, name), value, vocab_size, max_logprobs)
        kwargs: dict[str, Any] = dict(
            n=_or(self.n, 1),
            temperature=_or(self.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_or(self.top_k, defaults.get("top_k", 0)),
            min_p=_or(self.min_p, defaults.get("min_p", 0.0)),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(
                self.repetition_penalty, defaults.get("repetition_penalty", 1.0)
            ),
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            logprob_token_ids=self.logprob_token_ids,
            structured_outputs=self.structured_outputs_params(),
        )
        try:
            return SamplingParams.from_optional(**kwargs)
        except (ValueError, TypeError) as exc:
            name = str(exc).split(" ", 1)[0]
            param = renames.get(name, name) if name in kwargs else None
            raise RequestValidationError(str(exc), param=param) from exc

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The grammar the request holds its output to, from whichever field gave it (two
        fields asking for one are an error: which would win is not obvious)."""
        given: dict[str, dict[str, Any]] = {}
        if self.structured_outputs:
            given["structured_outputs"] = self.structured_outputs
        guided = {
            kind: getattr(self, f"guided_{kind}")
            for kind in ("json", "regex", "choice", "grammar")
            if getattr(self, f"guided_{kind}") is not None
        }
        if guided:
            given["guided_" + next(iter(guided))] = guided
        format_ = self.response_format
        if format_ is not None and format_.type != "text":
            schema = None if format_.json_schema is None else format_.json_schema.json_schema
            given["response_format"] = (
                {"json": schema} if schema is not None else {"json_object": True}
            )
        if not given:
            return None
        if len(given) > 1:
            raise RequestValidationError(
                f"{' and '.join(sorted(given))} each ask for structured outputs: send one",
                param=sorted(given)[1],
            )
        ((param, fields),) = given.items()
        known = sorted(field.name for field in dataclasses.fields(StructuredOutputsParams))
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise RequestValidationError(
                f"structured_outputs has no field {unknown[0]!r}; its fields are "
                f"{', '.join(known)}",
                param=param,
            )
        try:
            return StructuredOutputsParams(**fields)
        except (ValueError, TypeError) as error:
            raise RequestValidationError(str(error), param=param) from error

    def beam_search_params(
        self, sampling_params: SamplingParams, max_logprobs: int = MAX_LOGPROBS
    ) -> BeamSearchParams:
        """use_beam_search's settings, as vLLM's to_beam_search_params makes them (beam width
        n; max_tokens and temperature as `sampling_params` fitted them). What beam search
        cannot honour is refused, naming the field: it ranks beams by their logprobs, so no
        sampling filter, penalty, seed or stop condition but EOS applies. Each step asks for
        2 * n logprobs, held to the server's `max_logprobs` (-1: no limit)."""
        width = sampling_params.n
        if getattr(self, "echo", False) and sampling_params.prompt_logprobs is not None:
            raise RequestValidationError(
                "`echo` with `logprobs` asks for the prompt's logprobs, which beam search does "
                "not compute; omit one of them",
                param="echo",
            )
        if -1 < max_logprobs < 2 * width:
            raise RequestValidationError(
                f"use_beam_search with n={width} asks for 2 * n = {2 * width} logprobs a step, "
                f"more than this server's max_logprobs of {max_logprobs}: ask for n <= "
                f"{max_logprobs // 2}, or start the server with a larger --max-logprobs",
                param="n",
            )
        for name, no_ops in _NOT_WITH_BEAM_SEARCH.items():
            if not _asks_for_nothing(getattr(self, name), no_ops):
                raise RequestValidationError(
                    f"`{name}` does not apply to beam search (use_beam_search ranks beams by "
                    "their logprobs and ends them at EOS or max_tokens); omit it",
                    param=name,
                )
        return BeamSearchParams(
            beam_width=width,
            max_tokens=sampling_params.max_tokens or 1,
            ignore_eos=self.ignore_eos,
            temperature=sampling_params.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


# Request fields beam search cannot honour -> their values that ask for nothing (null and empty
# ones never do).
_NOT_WITH_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "seed": (), "stop": (),
    "stop_token_ids": (), "min_tokens": (0,), "logit_bias": (), "allowed_token_ids": (),
    "bad_words": (), "prompt_logprobs": (), "kv_transfer_params": (), "logprob_token_ids": (),
}  # fmt: skip

# Prompts as OpenAI takes them: one text, several texts, one token list, or several token lists.
PromptInput = str | list[str] | list[TokenId] | list[list[TokenId]]
_PROMPT_SHAPES = (
    "`prompt` must be a non-empty string, a list of them, a non-empty list of token ids "
    "(ints >= 0), or a list of those"
)


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    prompt: PromptInput
    echo: bool | None = False  # the prompt is put in front of each choice's text
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=1)
    add_special_tokens: bool = True  # e.g. BOS, when the route tokenizes the prompt
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        """Checked here, so a bad shape gets one message saying what is allowed instead of an
        error from every branch of the union."""

        def is_token_list(item: Any) -> bool:
            return isinstance(item, list) and all(
                type(token) is int and token >= 0 for token in item
            )

        if isinstance(value, str):
            ok = bool(value)
        elif isinstance(value, list) and value:
            ok = (
                all(isinstance(item, str) and item for item in value)
                or is_token_list(value)
                or all(is_token_list(item) and item for item in value)
            )
        else:
            ok = False
        if not ok:
            raise PydanticCustomError("prompt_shape", _PROMPT_SHAPES)
        return value

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a text or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def to_sampling_params(
        self,
        default_max_tokens: int,
        *,
        defaults: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> SamplingParams:
        """`default_max_tokens`: the room left in the context after this prompt; `defaults`:
        the model's generation-config defaults for fields left null; `vocab_size`: what -1
        logprobs would ask for, held to `max_logprobs` (-1: no limit). With `echo`, `logprobs`
        also asks for the prompt tokens' logprobs, as in OpenAI and vLLM."""
        explicit = "max_tokens" in self.model_fields_set
        max_tokens = _fit_max_tokens(
            "max_tokens",
            self.max_tokens if explicit else None,
            COMPLETION_DEFAULT_MAX_TOKENS,
            default_max_tokens,
            "prompt",
        )
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            renames={},
            defaults=defaults,
            vocab_size=vocab_size,
            max_logprobs=max_logprobs,
        )


class ChatCompletionRequest(_ChatPrompt, _Generation):
    """POST /v1/chat/completions."""

    logprobs: bool | None = False  # logprobs of the sampled tokens
    top_logprobs: int | None = Field(0, ge=-1, le=MAX_LOGPROBS)  # alternatives; -1: all
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's older name
    max_completion_tokens: int | None = Field(None, ge=1)  # wins over max_tokens
    # vLLM's: the reply starts with the last message's content when that message has the
    # reply's role (the server's --response-role, or with add_generation_prompt false the last
    # message's own role: a continued message comes back whole)
    echo: bool = False
    # accepted, no effect on the output
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # false: the first call a reply makes only
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None  # a latency hint: the output is the same
    # "none" (the default without tools), "auto" (the default with them: the reply's calls are
    # read out of its text by the server's --tool-call-parser), "required" or a named function
    # (the reply held to the calls' schema by structured outputs)
    tool_choice: str | NamedToolChoice | None = None
    # accepted so that asking for them is a clear error (see _UNSUPPORTED)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    moderation: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # false: no `reasoning` in the reply (--reasoning-parser)
    return_prompt_text: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise PydanticCustomError("needs_logprobs", "`top_logprobs` needs `logprobs: true`")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _known_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        """One error that says what is allowed (the union's would name each branch)."""
        choices = ", ".join(map(json.dumps, TOOL_CHOICES))
        allowed = PydanticCustomError(
            "tool_choice",
            f"`tool_choice` is one of {choices} or a named function, "
            '{"type": "function", "function": {"name": ...}}',
        )
        if isinstance(value, dict):
            try:
                value = NamedToolChoice.model_validate(value)
            except ValueError:  # pydantic's ValidationError is one
                raise allowed from None
        elif not isinstance(value, NamedToolChoice | None) and value not in TOOL_CHOICES:
            raise allowed
        tools = info.data.get("tools")
        if value not in (None, "none") and tools is None:
            raise PydanticCustomError("tool_choice", "`tool_choice` needs `tools`")
        if isinstance(value, NamedToolChoice) and value.function.name not in {
            tool.function.name for tool in tools or ()
        }:
            raise PydanticCustomError(
                "tool_choice", "the function `tool_choice` names is not among `tools`"
            )
        return value

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """As vLLM reads it: "auto" where tools are given and tool_choice is not, "none" where
        the tools are an empty list."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def to_sampling_params(
        self,
        default_max_tokens: int,
        *,
        defaults: Mapping[str, Any] | None = None,
        vocab_size: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> SamplingParams:
        """`default_max_tokens`: the room left in the context after the rendered conversation;
        without a limit the reply may fill it, as in vLLM, or stop at the generation config's
        max_new_tokens. `defaults`, `vocab_size`, `max_logprobs`: as for completions."""
        if self.max_completion_tokens is not None:
            param, requested = "max_completion_tokens", self.max_completion_tokens
        else:
            param, requested = "max_tokens", self.max_tokens
        fallback = (defaults or {}).get("max_tokens", default_max_tokens)
        max_tokens = _fit_max_tokens(param, requested, fallback, default_max_tokens, "messages")
        return self._sampling_params(
            max_tokens=max_tokens,
            logprobs=_or(self.top_logprobs, 0) if self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            renames={"max_tokens": param, "logprobs": "top_logprobs"},
            defaults=defaults,
            vocab_size=vocab_size,
            max_logprobs=max_logprobs,
        )


# ------------------------------------------------------------------ tokenize / detokenize input


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatPrompt):
    model: str | None = None
    return_token_strs: bool | None = False


def _tokenize_kind(body: Any) -> str:
    has_messages = isinstance(body, dict) and "messages" in body
    return "chat" if has_messages or isinstance(body, TokenizeChatRequest) else "completion"


# POST /tokenize takes either shape, told apart by `messages`. An error's loc starts with the
# branch ("completion" or "chat"); the field follows.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")]
    | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]
