"""From OpenAI requests to engine calls and back: tokenizing prompts, running one engine request
per prompt, and shaping RequestOutputs into OpenAI's responses and SSE chunks. No HTTP here."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from tandem.beam_search import BeamSearchParams, BeamSearchSequence
from tandem.engine.async_llm import AsyncLLM, OutputKind, RequestStream
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.sampling_params import SamplingParams, truncate_prompt
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestValidationError,
    TokenizeChatRequest,
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    PromptTokenUsageInfo,
    ToolCall,
    UsageInfo,
)
from tandem.server.protocol_responses import FunctionCall as ResponseFunctionCall
from tandem.server.reasoning_parsers import ReasoningParser, ReasoningStream
from tandem.server.tool_parsers import FunctionCall, ToolCallStream, ToolParser


@dataclass
class PromptJob:
    """One prompt of a request, ready for the engine."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


def _job(
    engine: AsyncLLM,
    request: CompletionRequest | ChatCompletionRequest,
    text: str | None,
    token_ids: list[int],
    prompt_param: str,
) -> PromptJob:
    if not token_ids:
        raise RequestValidationError(f"`{prompt_param}` is empty after tokenizing", prompt_param)
    try:  # before max_tokens is fitted to the room the prompt leaves
        token_ids = truncate_prompt(
            token_ids,
            request.truncate_prompt_tokens,
            engine.max_model_len,
            request.truncation_side or "left",
        )
    except ValueError as error:
        raise RequestValidationError(str(error), "truncate_prompt_tokens") from error
    if len(token_ids) >= engine.max_model_len:  # no room for output: say by how much
        try:
            engine.check_prompt(token_ids, None)
        except ValueError as error:
            raise RequestValidationError(str(error), prompt_param) from error
    params = request.to_sampling_params(
        engine.max_model_len - len(token_ids),
        defaults=engine.default_sampling_params,
        vocab_size=engine.vocab_size,
        max_logprobs=engine.config.max_logprobs,
    )
    try:
        engine.check_prompt(token_ids, params.max_tokens)
    except ValueError as error:
        raise RequestValidationError(str(error), prompt_param) from error
    try:
        params.check_vocab(engine.vocab_size)
    except ValueError as error:  # the message starts with the field's name
        raise RequestValidationError(str(error), str(error).split(" ", 1)[0]) from error
    return PromptJob(text, token_ids, params)


def encode(engine: AsyncLLM, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """Tokenize client text; text no tokenizer can take (e.g. a lone UTF-16 surrogate, which
    JSON can carry) is the request's fault, a 400 naming the field."""
    try:
        return engine.encode(text, add_special_tokens=add_special_tokens)
    except Exception as error:
        raise RequestValidationError(
            f"`{param}` could not be tokenized ({error}); send valid Unicode text", param
        ) from error


def completion_jobs(engine: AsyncLLM, request: CompletionRequest) -> list[PromptJob]:
    jobs = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            token_ids = encode(engine, prompt, request.add_special_tokens, "prompt")
            jobs.append(_job(engine, request, prompt, token_ids, "prompt"))
        else:
            text = engine.tokenizer.decode(prompt) if engine.tokenizer is not None else None
            jobs.append(_job(engine, request, text, list(prompt), "prompt"))
    return jobs


def render_chat(
    engine: AsyncLLM,
    request: ChatCompletionRequest | TokenizeChatRequest,
    exclude_tools: bool = False,
) -> str:
    """The conversation through the chat template, as the request asks, with its tools unless
    `exclude_tools`; a template that cannot render it is the request's fault (400)."""
    if engine.tokenizer is None:
        raise RequestValidationError("this server has no tokenizer, so no chat template")
    try:
        return engine.tokenizer.apply_chat_template(
            request.conversation(),
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            # the request's template kwargs win, as in vLLM
            **{
                "documents": request.documents,
                "tools": None if exclude_tools else request.template_tools(),
                **(request.chat_template_kwargs or {}),
            },
        )
    except Exception as error:
        raise RequestValidationError(
            f"the chat template could not render these messages: {error}", "messages"
        ) from error


def chat_job(
    engine: AsyncLLM, request: ChatCompletionRequest, exclude_tools: bool = False
) -> PromptJob:
    text = render_chat(engine, request, exclude_tools)
    token_ids = encode(engine, text, request.add_special_tokens, "messages")
    return _job(engine, request, text, token_ids, "messages")


def start_jobs(
    engine: AsyncLLM,
    jobs: Sequence[PromptJob],
    cache_salt: str | None,
    priority: int = 0,
    kv_transfer_params: dict | None = None,
) -> list[RequestStream]:
    """Queue every prompt as its own engine request, now (so they count against the waiting
    limit at once); if one is refused, those already queued are aborted."""
    base_id = uuid.uuid4().hex
    streams: list[RequestStream] = []
    try:
        for index, job in enumerate(jobs):
            streams.append(
                engine.add_request(
                    job.token_ids,
                    job.params,
                    f"{base_id}-{index}",
                    prompt=job.text,
                    output_kind=OutputKind.DELTA,
                    cache_salt=cache_salt,
                    priority=priority,
                    kv_transfer_params=kv_transfer_params,
                )
            )
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, delta output) as they come. Closing this iterator early aborts
    whatever is still running."""
    pending: dict[asyncio.Future, int] = {}
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, output
            return
        pending = {asyncio.ensure_future(anext(s)): index for index, s in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, output
    finally:
        for future in pending:
            future.cancel()
        for stream in streams:
            stream.cancel()


class BeamSearches:
    """A request's beam searches (use_beam_search), one task per prompt
    (AsyncLLM.beam_search), with their outputs in the shape of a request's streams: one
    finished RequestOutput per prompt whose choices are its best beams, best first. `cancel`
    aborts them, as it does a stream (the server calls it when the client goes away)."""

    def __init__(
        self,
        engine: AsyncLLM,
        jobs: Sequence[PromptJob],
        params: BeamSearchParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        base_id = uuid.uuid4().hex
        self.request_ids = [f"{base_id}-{index}" for index in range(len(jobs))]
        self.tasks = [
            asyncio.ensure_future(
                engine.beam_search(
                    job.token_ids, params, request_id, cache_salt=cache_salt, priority=priority
                )
            )
            for job, request_id in zip(jobs, self.request_ids, strict=True)
        ]
        self.arrival_time = time.monotonic()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, its output) as each search ends; closing it early cancels the rest."""
        index_of = {task: index for index, task in enumerate(self.tasks)}
        pending = set(self.tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.cancelled():
                        return
                    yield index_of[task], self._output(index_of[task], task.result())
        finally:
            self.cancel()

    def _output(self, prompt_index: int, beams: list[BeamSearchSequence]) -> RequestOutput:
        """The beams as choices: the generated tokens (a final EOS's included), their text
        without that EOS (as vLLM's server gives it), cumulative logprob and logprob rows."""
        job = self.jobs[prompt_index]
        num_prompt = len(job.token_ids)
        tokenizer = self.engine.tokenizer
        completions = []
        for index, beam in enumerate(beams):
            token_ids = beam.tokens[num_prompt:]
            shown = token_ids[:-1] if beam.finish_reason == "stop" else token_ids
            text = ""
            if tokenizer is not None:
                text = tokenizer.decode(shown, skip_special_tokens=job.params.skip_special_tokens)
            rows = beam.logprobs or None
            completion = CompletionOutput(
                index, text, token_ids, beam.cum_logprob, rows, beam.finish_reason
            )
            completions.append(completion)
        metrics = RequestMetrics(self.arrival_time, finished_time=time.monotonic())
        return RequestOutput(
            self.request_ids[prompt_index], job.text, job.token_ids, completions, True, metrics
        )


def new_token_times(output: RequestOutput) -> list[float]:
    """When each token of a DELTA output was sampled (the core's time.monotonic)."""
    times = []
    for completion in output.outputs:
        if completion.token_ids and completion.metrics is not None:
            times.extend(completion.metrics.token_times[-len(completion.token_ids) :])
    return times


# -- usage and logprobs ----------------------------------------------------------------------


class UsageCounter:
    """Token counts of a request across its prompts and choices, as OpenAI's usage reports."""

    def __init__(self, jobs: Sequence[PromptJob]) -> None:
        self.prompt_tokens = sum(len(job.token_ids) for job in jobs)
        self.completion_tokens = 0
        self.cached_tokens: dict[int, int] = {}

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens[prompt_index] = output.metrics.num_cached_tokens

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(
                cached_tokens=sum(self.cached_tokens.values())
            ),
        )


@dataclass(frozen=True)
class TokenText:
    """How logprobs name tokens: their text, or "token_id:{id}" (vLLM's
    return_tokens_as_token_ids, for clients that must know the exact token); `decode`: the text
    of a token that has no logprob row (the first prompt token of an echo)."""

    as_token_ids: bool = False
    decode: Callable[[int], str] | None = None

    def __call__(self, token_id: int, logprob: Logprob | None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None:
            return logprob.decoded_token or ""
        return "" if self.decode is None else self.decode(token_id)


def _top(
    row: dict[int, Logprob], limit: int, asked: Sequence[int] | None = None
) -> list[tuple[int, Logprob]]:
    """A row's alternatives, most likely first: its top `limit`, or where the request gave
    logprob_token_ids (`asked`), those tokens."""
    if asked:
        chosen = ((t, row[t]) for t in asked if t in row)
    else:
        chosen = ((t, lp) for t, lp in row.items() if lp.rank <= limit)
    return sorted(chosen, key=lambda item: item[1].rank)


def token_text_for(
    engine: AsyncLLM, request: CompletionRequest | ChatCompletionRequest, server_default: bool
) -> TokenText:
    """The request's return_tokens_as_token_ids, or where it leaves it null the server's."""
    as_token_ids = request.return_tokens_as_token_ids
    tokenizer = engine.tokenizer
    return TokenText(
        as_token_ids=server_default if as_token_ids is None else as_token_ids,
        decode=None if tokenizer is None else lambda token_id: tokenizer.decode([token_id]),
    )


def completion_logprobs(
    token_ids: list[int],
    rows: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    token_text: TokenText,
    asked: Sequence[int] | None = None,
    first_generated: int = 0,
) -> CompletionLogProbs:
    """Completions-style logprobs; a None row (the first prompt token) has no logprob. Text
    offsets count the tokens as named (as vLLM's do). `asked`: logprob_token_ids, the
    alternatives of the generated tokens (from `first_generated` on; an echoed prompt's
    keep their top `num_top`)."""
    result = CompletionLogProbs()
    for position, (token_id, row) in enumerate(zip(token_ids, rows, strict=True)):
        if row is None:
            result.tokens.append(token_text(token_id, None))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = row[token_id]
            result.tokens.append(token_text(token_id, chosen))
            result.token_logprobs.append(chosen.logprob)
            alternatives = _top(row, num_top, asked if position >= first_generated else None)
            top = {token_text(t, lp): lp.logprob for t, lp in alternatives}
            top.setdefault(result.tokens[-1], chosen.logprob)
            result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(result.tokens[-1])
    return result


def _chat_logprob(token_id: int, logprob: Logprob, token_text: TokenText) -> ChatCompletionLogProb:
    text = token_text(token_id, logprob)
    return ChatCompletionLogProb(
        token=text, logprob=logprob.logprob, bytes=list(text.encode("utf-8"))
    )


def chat_logprobs(
    token_ids: list[int],
    rows: Sequence[dict[int, Logprob]],
    num_top: int,
    token_text: TokenText,
    asked: Sequence[int] | None = None,
) -> ChatCompletionLogProbs:
    """`asked`: logprob_token_ids, every token's alternatives in place of its top `num_top`."""
    content = []
    for token_id, row in zip(token_ids, rows, strict=True):
        chosen = _chat_logprob(token_id, row[token_id], token_text)
        alternatives = _top(row, num_top, asked)
        content.append(
            ChatCompletionLogProbsContent(
                **chosen.model_dump(),
                top_logprobs=[_chat_logprob(t, lp, token_text) for t, lp in alternatives],
            )
        )
    return ChatCompletionLogProbs(content=content)


# -- /v1/completions -------------------------------------------------------------------------


class TextChunk:
    """The JSON of a stream chunk that carries only new text for one choice: nearly every
    chunk of a stream. Written from a template: the bytes the chunk's pydantic model gives
    (model_dump_json, exclude_none), for a third of the time."""

    def __init__(self, response_id: str, object_name: str, model: str, text_key: str) -> None:
        self.head = f'{{"id":{_json_string(response_id)},"object":"{object_name}","created":'
        self.middle = f',"model":{_json_string(model)},"choices":[{{"index":'
        self.text_key = text_key
        self.tail = "}" * text_key.count("{") + "}]}"

    def __call__(self, index: int, text: str) -> str:
        return (
            f"{self.head}{int(time.time())}{self.middle}{index},{self.text_key}"
            f"{_json_string(text)}{self.tail}"
        )


def _json_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _continuous_usage(request: CompletionRequest | ChatCompletionRequest) -> bool:
    options = request.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def _text_only(
    request: CompletionRequest | ChatCompletionRequest,
    news: Sequence[tuple[CompletionOutput, object]],
) -> bool:
    """Whether a delta's chunk carries nothing but text for one choice (TextChunk writes it):
    `news` pairs each choice with news with its logprobs (None: none to send)."""
    if len(news) != 1:
        return False
    completion, logprobs = news[0]
    return (
        logprobs is None
        and completion.finish_reason is None
        and completion.stop_reason is None
        and not request.return_token_ids
        and not _continuous_usage(request)
    )


def _plain_request(
    request: CompletionRequest | ChatCompletionRequest, wants_logprobs_or_echo: bool
) -> bool:
    """Whether a stream's chunks carry text alone until a choice finishes (TextChunk writes
    them, past the general path): no logprobs, echo, token ids or running usage."""
    return not (wants_logprobs_or_echo or request.return_token_ids or _continuous_usage(request))


def _running_choice(output: RequestOutput) -> CompletionOutput | None:
    """The choice of a delta output for n = 1 while it runs (not its last): the chunk of a
    plain stream is its text alone."""
    if len(output.outputs) == 1 and output.outputs[0].finish_reason is None:
        return output.outputs[0]
    return None


@dataclass
class _ChoiceStreams:
    """A streamed chat choice's parsers: its thinking split off, then its calls read."""

    reasoning: ReasoningStream | None
    tools: ToolCallStream | None

    def feed(self, piece: str, finished: bool) -> tuple[str, str, list[FunctionCall]]:
        """The piece's (reasoning, content) to send, and at the reply's end its calls."""
        reasoning, content = ("", piece) if self.reasoning is None else self.reasoning.feed(piece)
        if finished and self.reasoning is not None:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[FunctionCall] = []
        if self.tools is not None:
            content = self.tools.feed(content)
            if finished:
                rest, calls = self.tools.finish()
                content += rest
        return reasoning, content, calls


@dataclass
class _ChoiceState:
    """What a completions choice has sent so far (for echo and text offsets)."""

    text_length: int = 0
    echoed: bool = False
    finish_sent: bool = False


class CompletionShaper:
    """Builds /v1/completions bodies and chunks from delta outputs."""

    def __init__(
        self, request: CompletionRequest, jobs: list[PromptJob], model: str, token_text: TokenText
    ) -> None:
        self.request = request
        self.jobs = jobs
        self.model = model
        self.token_text = token_text
        self.n = jobs[0].params.n
        self.response_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        self.usage = UsageCounter(jobs)
        self.choices: dict[int, _ChoiceState] = {}
        self.text_chunk = TextChunk(self.response_id, "text_completion", model, '"text":')
        self.plain = _plain_request(request, bool(request.echo) or request.logprobs is not None)

    def opening_chunks(self) -> list[CompletionStreamResponse]:
        return []

    def choice_index(self, prompt_index: int, completion: CompletionOutput) -> int:
        return prompt_index * self.n + completion.index

    def _choice_text_and_logprobs(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> tuple[str, CompletionLogProbs | None]:
        """The delta's text (with the prompt in front on a choice's first piece if echo) and
        its logprobs (the prompt's too, then)."""
        state = self.choices.setdefault(self.choice_index(prompt_index, completion), _ChoiceState())
        job = self.jobs[prompt_index]
        text = completion.text
        token_ids, rows = completion.token_ids, completion.logprobs
        prompt_rows = output.prompt_logprobs
        first_generated = 0
        if self.request.echo and not state.echoed:
            state.echoed = True
            text = (job.text or "") + text
            if rows is not None:
                prompt = prompt_rows or [None] * len(job.token_ids)
                token_ids, rows = job.token_ids + token_ids, list(prompt) + rows
                first_generated = len(job.token_ids)
        logprobs = None
        if rows is not None and self.request.logprobs is not None:
            logprobs = completion_logprobs(
                token_ids, rows, self.request.logprobs, state.text_length, self.token_text,
                job.params.logprob_token_ids, first_generated,
            )  # fmt: skip
        state.text_length += len(text)
        return text, logprobs

    def response(self, outputs: dict[int, RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index in sorted(outputs):
            output = outputs[prompt_index]
            self.usage.add(prompt_index, output)
            for completion in output.outputs:
                text, logprobs = self._choice_text_and_logprobs(prompt_index, output, completion)
                choices.append(
                    CompletionResponseChoice(
                        index=self.choice_index(prompt_index, completion),
                        text=text,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=output.prompt_logprobs,
                        prompt_token_ids=(
                            self.jobs[prompt_index].token_ids
                            if self.request.return_token_ids
                            else None
                        ),
                        token_ids=completion.token_ids if self.request.return_token_ids else None,
                    )
                )
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=self.usage.usage(),
            kv_transfer_params=outputs[0].kv_transfer_params if len(outputs) == 1 else None,
        )

    def chunk(
        self, prompt_index: int, output: RequestOutput
    ) -> CompletionStreamResponse | str | None:
        """The chunk for a delta output: its model, or its JSON when it carries only text
        (TextChunk); None when there is nothing new."""
        self.usage.add(prompt_index, output)
        if self.plain and (running := _running_choice(output)) is not None:
            if not running.token_ids:
                return None
            return self.text_chunk(self.choice_index(prompt_index, running), running.text)
        news = []
        for completion in output.outputs:
            state = self.choices.setdefault(
                self.choice_index(prompt_index, completion), _ChoiceState()
            )
            if state.finish_sent or (not completion.token_ids and completion.finish_reason is None):
                continue  # nothing new: a DELTA output for n > 1 repeats finished sequences
            state.finish_sent = completion.finish_reason is not None
            text, logprobs = self._choice_text_and_logprobs(prompt_index, output, completion)
            news.append((completion, text, logprobs))
        if not news:
            return None
        if _text_only(self.request, [(completion, logprobs) for completion, _, logprobs in news]):
            first, first_text, _ = news[0]
            return self.text_chunk(self.choice_index(prompt_index, first), first_text)
        choices = [
            CompletionResponseStreamChoice(
                index=self.choice_index(prompt_index, completion),
                text=text,
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                token_ids=completion.token_ids if self.request.return_token_ids else None,
            )
            for completion, text, logprobs in news
        ]
        usage = self.usage.usage() if _continuous_usage(self.request) else None
        return CompletionStreamResponse(
            id=self.response_id, model=self.model, choices=choices, usage=usage
        )

    def usage_chunk(self) -> CompletionStreamResponse | None:
        options = self.request.stream_options
        if not (options and options.include_usage):
            return None
        return CompletionStreamResponse(
            id=self.response_id, model=self.model, choices=[], usage=self.usage.usage()
        )


# -- /v1/chat/completions --------------------------------------------------------------------


class ChatShaper:
    """Builds /v1/chat/completions bodies and chunks from delta outputs."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        job: PromptJob,
        model: str,
        token_text: TokenText,
        response_role: str = "assistant",
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
    ) -> None:
        """`tool_parser`: reads each reply's calls out of its text (tool_choice "auto");
        `reasoning_parser`: splits its thinking from its answer, whose calls are read."""
        self.request = request
        self.job = job
        self.model = model
        self.token_text = token_text
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.streams: dict[int, _ChoiceStreams] = {}  # by choice, while they stream
        # false: a reply's first call only (as vLLM)
        self.num_calls_kept = 1 if request.parallel_tool_calls is False else None
        # vLLM's rule: a new message has the server's role; a continued one keeps its own.
        last = request.messages[-1]
        self.role = response_role if request.add_generation_prompt else last.role
        # echo: the reply starts with the last message's text when that message has its role
        self.echo = last.text if request.echo and last.role == self.role else ""
        self.response_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self.usage = UsageCounter([job])
        self.num_top = request.top_logprobs or 0
        self.finish_sent: set[int] = set()  # choices whose last chunk has gone out
        self.text_chunk = TextChunk(
            self.response_id, "chat.completion.chunk", model, '"delta":{"content":'
        )
        self.parses = tool_parser is not None or reasoning_parser is not None
        self.plain = _plain_request(request, bool(request.logprobs)) and not self.parses

    def _tool_calls(self, calls: list[FunctionCall]) -> list[ToolCall]:
        if self.tool_parser is None:
            return []
        return [
            ToolCall(
                id=self.tool_parser.call_id(),
                function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in calls[: self.num_calls_kept]
        ]

    def _message(self, completion: CompletionOutput) -> tuple[ChatMessage, str | None]:
        """A whole reply's message, its thinking split off and its calls read out where the
        parsers are set, and its finish reason ("tool_calls" where it made calls)."""
        if not self.parses:
            message = ChatMessage(role=self.role, content=self.echo + completion.text)
            return message, completion.finish_reason
        reasoning, content = None, completion.text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.split(completion.text)
        calls: list[FunctionCall] = []
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract(content or "")
            content, calls = extracted.content, extracted.calls
        if not self.request.include_reasoning:
            reasoning = None
        message = ChatMessage(
            role=self.role,
            content=self.echo + content if content else self.echo or None,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=self._tool_calls(calls),
        )
        return message, self._finish_reason(completion, calls)

    def _finish_reason(self, completion: CompletionOutput, calls: list[FunctionCall]) -> str | None:
        """The reply's finish reason: "tool_calls" where the model chose to call (tool_choice
        "auto"), else the engine's."""
        forced = self.tool_parser is not None and self.tool_parser.forced
        return "tool_calls" if calls and not forced else completion.finish_reason

    def _logprobs(self, completion: CompletionOutput) -> ChatCompletionLogProbs | None:
        if not self.request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(
            completion.token_ids, completion.logprobs, self.num_top, self.token_text,
            self.job.params.logprob_token_ids,
        )  # fmt: skip

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        self.usage.add(0, output)
        choices = []
        for completion in output.outputs:
            message, finish_reason = self._message(completion)
            choices.append(
                ChatCompletionResponseChoice(
                    index=completion.index,
                    message=message,
                    logprobs=self._logprobs(completion),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                    token_ids=completion.token_ids if self.request.return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=self.usage.usage(),
            prompt_logprobs=output.prompt_logprobs,
            prompt_token_ids=self.job.token_ids if self.request.return_token_ids else None,
            kv_transfer_params=output.kv_transfer_params,
        )

    def opening_chunks(self) -> list[ChatCompletionStreamResponse]:
        """OpenAI streams open each choice with the role and empty content; with echo, a chunk
        per choice with the echoed text follows (as vLLM sends it)."""
        choices = [
            ChatCompletionResponseStreamChoice(
                index=index, delta=DeltaMessage(role=self.role, content="")
            )
            for index in range(self.job.params.n)
        ]
        opening = ChatCompletionStreamResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            prompt_token_ids=self.job.token_ids if self.request.return_token_ids else None,
        )
        echoes = [
            ChatCompletionStreamResponse(
                id=self.response_id,
                model=self.model,
                choices=[
                    ChatCompletionResponseStreamChoice(
                        index=index, delta=DeltaMessage(content=self.echo)
                    )
                ],
            )
            for index in range(self.job.params.n if self.echo else 0)
        ]
        return [opening, *echoes]

    def chunk(
        self, prompt_index: int, output: RequestOutput
    ) -> ChatCompletionStreamResponse | str | None:
        """The chunk for a delta output (a chat has one prompt: index 0): its model, or its
        JSON when it carries only text (TextChunk); None when there is nothing new."""
        self.usage.add(prompt_index, output)
        if self.plain and (running := _running_choice(output)) is not None:
            return self.text_chunk(running.index, running.text) if running.token_ids else None
        news = [  # a DELTA output for n > 1 repeats the sequences that finished earlier
            completion
            for completion in output.outputs
            if completion.index not in self.finish_sent
            and (completion.token_ids or completion.finish_reason is not None)
        ]
        if not news:
            return None
        self.finish_sent.update(c.index for c in news if c.finish_reason is not None)
        with_logprobs = [(completion, self._logprobs(completion)) for completion in news]
        if not self.parses and _text_only(self.request, with_logprobs):
            return self.text_chunk(news[0].index, news[0].text)
        choices = []
        for completion, logprobs in with_logprobs:
            delta, finish_reason = self._delta(completion)
            nothing_else = logprobs is None and not self.request.return_token_ids
            if delta is None and finish_reason is None and nothing_else:
                continue  # text held back (it may be a call), and nothing else to send
            choices.append(
                ChatCompletionResponseStreamChoice(
                    index=completion.index,
                    delta=delta or DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                    token_ids=completion.token_ids if self.request.return_token_ids else None,
                )
            )
        if not choices:
            return None
        return ChatCompletionStreamResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=self.usage.usage() if _continuous_usage(self.request) else None,
        )

    def _delta(self, completion: CompletionOutput) -> tuple[DeltaMessage | None, str | None]:
        """A streamed choice's new piece (None: nothing to send yet) and finish reason. With
        the parsers, thinking and answer are split as they come, and text that may be a call
        waits for the reply's end (ToolCallStream)."""
        if not self.parses:
            return DeltaMessage(content=completion.text), completion.finish_reason
        streams = self.streams.get(completion.index)
        if streams is None:
            thinking, tools = self.reasoning_parser, self.tool_parser
            streams = self.streams[completion.index] = _ChoiceStreams(
                None if thinking is None else ReasoningStream(thinking),
                None if tools is None else ToolCallStream(tools),
            )
        finished = completion.finish_reason is not None
        reasoning, content, calls = streams.feed(completion.text, finished)
        if finished:
            del self.streams[completion.index]
        if not self.request.include_reasoning:
            reasoning = ""
        deltas = [
            DeltaToolCall(
                index=index,
                id=call.id,
                type=call.type,
                function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for index, call in enumerate(self._tool_calls(calls))
        ]
        if not (finished or reasoning or content):
            return None, None
        delta = DeltaMessage(
            content=content or None,
            reasoning=reasoning or None,
            reasoning_content=reasoning or None,
            tool_calls=deltas or None,
        )
        return delta, self._finish_reason(completion, calls)

    def usage_chunk(self) -> ChatCompletionStreamResponse | None:
        options = self.request.stream_options
        if not (options and options.include_usage):
            return None
        return ChatCompletionStreamResponse(
            id=self.response_id, model=self.model, choices=[], usage=self.usage.usage()
        )
