"""The HTTP face: FastAPI routes that parse a request, call the engine and stream the answer.
Everything OpenAI-shaped lives in protocol*.py and serving.py; the step loop lives in another
process. Errors are OpenAI's JSON with a 4xx code that says what to change."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tandem
from tandem.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    RequestRefusedError,
    RequestStream,
    merge_delta_outputs,
)
from tandem.kv_transfer.params import check_kv_transfer as check_kv_transfer_params
from tandem.outputs import RequestOutput
from tandem.server.metrics import PrometheusStatLogger
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    RequestValidationError,
    TokenizeChatRequest,
    TokenizeRequest,
)
from tandem.server.protocol_responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    error_body,
)
from tandem.server.reasoning_parsers import reasoning_parser
from tandem.server.serving import (
    BeamSearches,
    ChatShaper,
    CompletionShaper,
    PromptJob,
    chat_job,
    completion_jobs,
    encode,
    merge_streams,
    new_token_times,
    render_chat,
    start_jobs,
    token_text_for,
)
from tandem.server.tool_parsers import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    function_parameters,
    required_calls_schema,
    tool_parser,
)

logger = logging.getLogger("tandem.server")
T = TypeVar("T")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_root: str
    api_key: str | None = None
    max_waiting: int | None = None  # waiting requests above which new ones get a 503
    max_request_bytes: int = 32 << 20
    trust_request_chat_template: bool = False  # a request's own template runs in this process
    response_role: str = "assistant"  # of chat replies that start a new message (vLLM's flag)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:{id}" by default
    # --enable-auto-tool-choice's --tool-call-parser (None: tool_choice "auto" is refused)
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag of that name
    reasoning_parser: str | None = None  # --reasoning-parser: chat replies' thinking split off
    draining: bool = False  # set on SIGTERM: no new requests, in-flight ones finish
    extra: dict[str, Any] = field(default_factory=dict)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, error.type, error.param, error.code or error.status),
        status_code=error.status,
        headers=error.headers,
    )


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """The first error, with the field it is about (the body's top-level field as param)."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = "unknown field: neither OpenAI's API nor vLLM's extensions have it; remove it"
    elif first.get("type") == "json_invalid":
        return "the body is not valid JSON", None
    return (f"{where}: {message}" if where else message), param


class Gate:
    """Pure ASGI (no re-buffering of streamed responses): the API key on /v1, no new work while
    draining, and 413 for a body over the limit, judged by Content-Length and, for chunked
    bodies, by counting as it arrives."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await _error_response(error)(scope, receive, send)
            return
        limit, received = self.settings.max_request_bytes, 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # FastAPI turns anything but an HTTPException into a 400
                    raise StarletteHTTPException(413, self._too_large())
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> str:
        limit = self.settings.max_request_bytes
        return f"the request body is over {limit} bytes (--max-request-bytes); send less"

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        settings = self.settings
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if settings.api_key is not None and path.startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(
                token.strip(), settings.api_key.encode()
            ):
                return OpenAIError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                    "with the server's --api-key",
                    "authentication_error",
                )
        if settings.draining and scope.get("method") == "POST" and path.startswith("/v1"):
            return OpenAIError(
                503, "the server is shutting down; retry elsewhere", "service_unavailable",
                headers={"Retry-After": "1"},
            )  # fmt: skip
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > settings.max_request_bytes:
            return OpenAIError(413, self._too_large())
        return None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # only requests it: wait until it has unwound (and aborted)
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)  # nobody is listening
    return task.result()


async def _sse_stream(
    request: Request,
    streams: list[RequestStream] | list[BeamSearches],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    shaper: CompletionShaper | ChatShaper,
    stats: PrometheusStatLogger | None,
) -> AsyncIterator[str]:
    """A streamed response's SSE events, from the engine's delta outputs in one generator (each
    layer of generators is paid per token); after each event is written, how long its tokens
    took since sampling. Uvicorn (ASGI 2.4) reports a gone client only when a send fails, and
    the first token can be long in coming: watch for the disconnect ourselves. It cancels the
    engine requests at once, which ends `outputs` and so this stream; no task per chunk."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))

    def on_disconnect(task: asyncio.Future) -> None:
        if not task.cancelled():
            for stream in streams:
                stream.cancel()

    watcher.add_done_callback(on_disconnect)
    try:
        for chunk in shaper.opening_chunks():
            yield _sse(chunk)
        async for prompt_index, output in outputs:
            if watcher.done():
                return
            chunk = shaper.chunk(prompt_index, output)
            if chunk is None:
                continue
            yield _sse(chunk)
            if stats is not None:
                stats.record_token_delivery(time.monotonic(), new_token_times(output))
        usage = shaper.usage_chunk()
        if usage is not None:
            yield _sse(usage)
    except EngineDeadError as error:
        yield _sse(error_body(str(error), "service_unavailable", None, 503))
    except ValueError as error:
        yield _sse(error_body(str(error), "invalid_request_error", None, 400))
    finally:
        watcher.cancel()
        await outputs.aclose()
    yield "data: [DONE]\n\n"


_TOKENIZE_INLINE_BYTES = 16 << 10  # request bodies up to this are tokenized on the event loop
_tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenize")


async def off_loop_if_large(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` (templating, tokenizing) on the event loop for a small body, where a thread hop
    would cost more than the work; a large one runs on the tokenizer thread, so a megabyte
    prompt does not hold up every other stream's tokens. One thread: the tokenizer is never
    entered by two prompts at once."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) <= _TOKENIZE_INLINE_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_tokenizer_thread, fn, *args)


def _sse(payload: BaseModel | dict | str) -> str:
    """One SSE event; a str payload is JSON already (serving.TextChunk)."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="tandem", version=tandem.__version__)
    app.add_middleware(Gate, settings=settings)
    stats = next((s for s in engine.stat_loggers if isinstance(s, PrometheusStatLogger)), None)
    model_name = settings.served_model_names[0]
    transfer = engine.config.kv_transfer
    if stats is not None and transfer is not None and transfer.role == "prefill":
        stats.kv_transfer_endpoint(transfer.host, transfer.port)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(FastAPIValidationError)
    async def _invalid(_: Request, error: FastAPIValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return _error_response(OpenAIError(400, message, param=param))

    @app.exception_handler(RequestValidationError)
    async def _cannot_serve(_: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(OpenAIError(400, error.message, param=error.param))

    @app.exception_handler(RequestRefusedError)
    async def _refused(_: Request, error: RequestRefusedError) -> JSONResponse:
        return _error_response(OpenAIError(400, str(error)))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return _error_response(OpenAIError(503, str(error), "service_unavailable"))

    @app.exception_handler(Exception)
    async def _bug(_: Request, error: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=error)
        return _error_response(
            OpenAIError(500, f"internal server error: {type(error).__name__}", "server_error")
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(error.status_code, str(error.detail), kind))

    def check_model(requested: str | None) -> None:
        if requested is not None and requested not in settings.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{requested}` does not exist; this server serves "
                f"{', '.join(settings.served_model_names)}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    def check_chat_template(body: ChatCompletionRequest | TokenizeChatRequest) -> None:
        kwargs = body.chat_template_kwargs or {}
        if settings.trust_request_chat_template or (
            body.chat_template is None and "chat_template" not in kwargs
        ):
            return
        raise OpenAIError(
            400,
            "this server does not run chat templates sent with requests (a template is code "
            "run in the server); leave out `chat_template`, or start the server with "
            "--trust-request-chat-template",
            param="chat_template",
        )

    def tool_calling(
        body: ChatCompletionRequest,
    ) -> tuple[ChatCompletionRequest, ToolParser | None]:
        """The request as it runs (its special tokens kept where the parser reads them) and
        the parser of its replies' calls: its tool_choice, as this server can honour it."""
        choice = body.effective_tool_choice
        if choice == "none":
            return body, None
        if choice != "auto":
            return forced_tool_calls(body, choice)
        if settings.tool_call_parser is None:
            raise OpenAIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (tools without a tool_choice mean "auto"); start the server so, or '
                'send tool_choice "none"',
                param="tool_choice",
            )
        parser = tool_parser(settings.tool_call_parser)
        if parser.keeps_special_tokens:  # its markers may be special tokens
            body = body.model_copy(update={"skip_special_tokens": False})
        return body, parser

    def forced_tool_calls(
        body: ChatCompletionRequest, choice: str | NamedToolChoice
    ) -> tuple[ChatCompletionRequest, ToolParser]:
        """tool_choice "required" or a named function, as vLLM does them: the reply held to
        the calls' JSON schema (structured outputs), then read as calls."""
        if body.structured_outputs_params() is not None:
            raise OpenAIError(
                400,
                'tool_choice "required" or naming a function holds the reply to the calls\' '
                "schema, so it cannot also be held to response_format, structured_outputs or "
                "guided_*: send one of them",
                param="tool_choice",
            )
        functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools or ()]
        parser: ToolParser
        if isinstance(choice, NamedToolChoice):
            (function,) = [f for f in functions if f["name"] == choice.function.name]
            schema = function_parameters(function)
            parser = NamedToolParser(choice.function.name)
        else:
            try:
                schema = required_calls_schema(functions, body.parallel_tool_calls is False)
            except ValueError as error:
                raise OpenAIError(400, str(error), param="tools") from error
            parser = RequiredToolParser()
        return body.model_copy(update={"structured_outputs": {"json": schema}}), parser

    def check_priority(body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.priority != 0 and engine.config.scheduler.scheduling_policy != "priority":
            raise OpenAIError(
                400,
                "`priority` is set but this server schedules first come, first served: send "
                "priority 0, or start the server with --scheduling-policy priority",
                param="priority",
            )

    def start(
        body: CompletionRequest | ChatCompletionRequest, jobs: list[PromptJob]
    ) -> tuple[list[RequestStream] | list[BeamSearches], AsyncIterator[tuple[int, RequestOutput]]]:
        """Queue the request's prompts (or start their beam searches): what the disconnect
        watcher cancels, and the (prompt index, delta output) pairs the shaper takes."""
        if body.use_beam_search:
            params = body.beam_search_params(jobs[0].params, engine.config.max_logprobs)
            searches = BeamSearches(engine, jobs, params, body.cache_salt, body.priority)
            return [searches], searches.outputs()
        check_kv_transfer(body, jobs)
        streams = start_jobs(engine, jobs, body.cache_salt, body.priority, body.kv_transfer_params)
        return streams, merge_streams(streams)

    def check_kv_transfer(
        body: CompletionRequest | ChatCompletionRequest, jobs: list[PromptJob]
    ) -> None:
        """kv_transfer_params this instance can act on, for one prompt: refused here, before
        anything is queued (a prefill instance's answer is in its response body only)."""
        params = body.kv_transfer_params
        if not params:
            return
        if len(jobs) != 1:
            raise OpenAIError(
                400, "kv_transfer_params is for one prompt: send the prompts as separate requests",
                param="kv_transfer_params",
            )  # fmt: skip
        transfer = engine.config.kv_transfer
        try:
            check_kv_transfer_params(
                params, "both" if transfer is None else transfer.role, jobs[0].token_ids,
                jobs[0].params, engine.config.runner.block_size, engine.vocab_size,
            )  # fmt: skip
        except ValueError as error:
            raise OpenAIError(400, str(error), param="kv_transfer_params") from error
        if params.get("do_remote_decode") is True and body.stream:
            raise OpenAIError(
                400,
                "kv_transfer_params.do_remote_decode returns where the KV waits in the response "
                "body: send stream false",
                param="stream",
            )
        if params and _or_one(body.n) != 1:
            raise OpenAIError(
                400, "kv_transfer_params needs n=1: the first token is one sequence's", param="n"
            )

    def check_capacity() -> None:
        if engine.dead_error is not None:
            raise engine.dead_error
        if settings.max_waiting is not None and engine.num_waiting >= settings.max_waiting:
            raise OpenAIError(
                503,
                f"the server is overloaded: {engine.num_waiting} requests are waiting "
                f"(--max-waiting {settings.max_waiting}); retry shortly",
                "service_unavailable",
                headers={"Retry-After": "1"},
            )

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return _error_response(OpenAIError(503, str(engine.dead_error), "service_unavailable"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": tandem.__version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if stats is None:
            return Response(status_code=404)
        body, content_type = stats.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=settings.model_root, max_model_len=engine.max_model_len)
                for name in settings.served_model_names
            ]
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        check_priority(body)
        check_capacity()
        jobs = await off_loop_if_large(request, completion_jobs, engine, body)
        check_capacity()  # again: the queue may have grown while this request was tokenized
        token_text = token_text_for(engine, body, settings.return_tokens_as_token_ids)
        shaper = CompletionShaper(body, jobs, model_name, token_text)
        streams, outputs = start(body, jobs)
        if body.stream:
            return StreamingResponse(
                _sse_stream(request, streams, outputs, shaper, stats),
                media_type="text/event-stream",
            )
        return await _cancel_on_disconnect(request, _collect(outputs, shaper.response))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        check_chat_template(body)
        check_priority(body)
        check_capacity()
        body, parser = tool_calling(body)
        exclude_tools = (
            settings.exclude_tools_when_tool_choice_none and body.effective_tool_choice == "none"
        )
        job = await off_loop_if_large(request, chat_job, engine, body, exclude_tools)
        check_capacity()
        token_text = token_text_for(engine, body, settings.return_tokens_as_token_ids)
        thinking = settings.reasoning_parser
        shaper = ChatShaper(
            body, job, model_name, token_text, settings.response_role, parser,
            None if thinking is None else reasoning_parser(thinking),
        )  # fmt: skip
        streams, outputs = start(body, [job])
        if body.stream:
            return StreamingResponse(
                _sse_stream(request, streams, outputs, shaper, stats),
                media_type="text/event-stream",
            )

        async def respond() -> Any:
            return await _collect(outputs, lambda merged: shaper.response(merged[0]))

        return await _cancel_on_disconnect(request, respond())

    @app.post("/tokenize")
    async def tokenize(
        body: Annotated[TokenizeRequest, Body()], request: Request
    ) -> TokenizeResponse:
        check_model(body.model)
        if engine.tokenizer is None:
            raise OpenAIError(400, "this server has no tokenizer")
        if isinstance(body, TokenizeChatRequest):
            check_chat_template(body)

        def token_ids_of_body() -> list[int]:
            if isinstance(body, TokenizeChatRequest):
                text, param = render_chat(engine, body), "messages"
            else:
                text, param = body.prompt, "prompt"
            return encode(engine, text, body.add_special_tokens, param)

        token_ids = await off_loop_if_large(request, token_ids_of_body)
        token_strs = None
        if body.return_token_strs:
            token_strs = engine.tokenizer.convert_ids_to_tokens(token_ids)
        return TokenizeResponse(
            tokens=token_ids,
            count=len(token_ids),
            max_model_len=engine.max_model_len,
            token_strs=token_strs,
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        if engine.tokenizer is None:
            raise OpenAIError(400, "this server has no tokenizer")
        bad = [t for t in body.tokens if t >= engine.vocab_size]
        if bad:
            raise OpenAIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
                param="tokens",
            )  # fmt: skip
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    return app


def _or_one(value: int | None) -> int:
    return 1 if value is None else value


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], respond) -> Any:
    """Drain a request's delta outputs into one output per prompt, then build the body."""
    merged: dict[int, RequestOutput] = {}
    async for prompt_index, output in outputs:
        previous = merged.get(prompt_index)
        merged[prompt_index] = output if previous is None else merge_delta_outputs(previous, output)
    return respond(merged)
