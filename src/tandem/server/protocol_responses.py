"""The OpenAI-compatible API's response bodies and its error body, as pydantic models.

Field names and `object` values are OpenAI's, so its clients parse them; vLLM's additions
(`stop_reason`, `prompt_logprobs`, token ids, `max_model_len`) ride along as optional fields that
those clients ignore. The request bodies live in protocol.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, computed_field

# --------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: clients read `error.message` and `error.param`."""

    error: ErrorInfo


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: int | str | None = None,
) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=type, param=param, code=code)
    ).model_dump()


# ------------------------------------------------------------------------------------ responses


def _random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _finite_logprob(value: Any) -> Any:
    """-inf (a token the sampler ruled out) is not JSON and would go out as null, which
    clients cannot parse as a number; -9999.0 stands for it, as in vLLM."""
    if isinstance(value, float) and not value > -9999.0:
        return -9999.0
    return value


LogprobValue = Annotated[float, BeforeValidator(_finite_logprob)]


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @computed_field
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class PromptLogprob(BaseModel):
    """vLLM's per-token prompt logprob entry, keyed by token id in `prompt_logprobs`; built
    straight from the engine's `tandem.outputs.Logprob` objects."""

    model_config = ConfigDict(from_attributes=True)

    logprob: LogprobValue
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # None for the first prompt token


class CompletionLogProbs(BaseModel):
    """The completions API's logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[LogprobValue | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, LogprobValue] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop", "length"; "abort" if the engine gave up
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's (disaggregation)


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only
    token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: _random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None  # the last chunk's, with stream_options.include_usage


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: LogprobValue
    bytes: list[int] | None = None  # the token's UTF-8 bytes: a token can split a character


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # The server's --response-role; with add_generation_prompt false, the last message's role
    # (vLLM's rule).
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # as vLLM: [] for none
    # --reasoning-parser: the thinking, under vLLM's name and its older one
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's (disaggregation)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a call: its first carries the id, type and name (tandem sends each call
    whole, in one piece)."""

    index: int  # of the call within the reply
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What a stream chunk adds: the role on the first chunk, then text (thinking, answer), or
    calls."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # the same, vLLM's older name
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: _random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: str | None = None  # where the weights came from
    parent: str | None = None
    max_model_len: int | None = None  # vLLM's addition: clients size prompts by it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
