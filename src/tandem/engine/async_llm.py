"""`AsyncLLM`: the Python face of the server's two processes. Tokenizing, stop strings and
detokenizing run here (the API process); the engine core runs in its own process. An output
task receives each step's message, turns it into RequestOutputs and hands each request its news
without ever awaiting a client, so a slow reader cannot slow the step loop or its neighbours."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from tandem.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, first_row
from tandem.engine.config import EngineConfig
from tandem.engine.core_client import EngineCoreClient, EngineDeadError
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    CoreReady,
    OutputsWritten,
    UtilityCall,
    UtilityResult,
)
from tandem.engine.output_processor import OutputKind, OutputProcessor
from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StatLogger
from tandem.engine.tokenizer import load_tokenizer
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "OutputKind", "RequestRefusedError"]


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    if last is None:
        raise EngineDeadError(f"request {stream.request_id} ended without an output")
    return last


class RequestRefusedError(ValueError):
    """The engine core refused a request it had been sent (the caller's input: a 400)."""


def _merge_delta(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(
        new,
        text=old.text + new.text,
        token_ids=old.token_ids + new.token_ids,
        logprobs=None if new.logprobs is None else (old.logprobs or []) + new.logprobs,
    )


def merge_delta_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One DELTA output that says what `old` and then `new` said."""
    pairs = zip(old.outputs, new.outputs, strict=True)
    merged = dataclasses.replace(new, outputs=[_merge_delta(a, b) for a, b in pairs])
    if new.prompt_logprobs is None and old.prompt_logprobs is not None:
        merged.prompt_logprobs = old.prompt_logprobs
    return merged


class _OutputCollector:
    """One request's mailbox: the newest undelivered output. DELTA outputs that pile up while
    the consumer is busy are merged, never queued without bound."""

    def __init__(self, output_kind: OutputKind) -> None:
        self.output_kind = output_kind
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.output is not None and self.output_kind is OutputKind.DELTA:
            output = merge_delta_outputs(self.output, output)
        self.output = output
        self.ready.set()

    def put_error(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def close(self) -> None:
        """Wake a waiting `get` with nothing: the request was cancelled."""
        self.ready.set()

    async def get(self) -> RequestOutput | None:
        """The next output; None once closed with nothing left."""
        await self.ready.wait()
        if self.output is None and self.error is not None:
            raise self.error
        output, self.output = self.output, None
        self.ready.clear()
        return output


class RequestStream:
    """A queued request's outputs, as an async iterator; closing it before the request
    finishes (break, cancellation, a client gone) aborts the request, started or not."""

    def __init__(self, engine: AsyncLLM, request_id: str, collector: _OutputCollector) -> None:
        self.engine = engine
        self.request_id = request_id
        self.collector = collector
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self.collector.get()
        except BaseException:
            self.cancel()
            raise
        if output is None:  # cancelled while waiting
            raise StopAsyncIteration
        self.finished = output.finished
        return output

    def cancel(self) -> None:
        """Abort the request unless it has finished; a task waiting for its next output
        gets the end of the stream."""
        if not self.finished:
            self.finished = True
            self.engine._abort(self.request_id)
            self.collector.close()

    async def aclose(self) -> None:
        self.cancel()


class AsyncLLM:
    """Create with `await AsyncLLM.create(config)`; `generate` is an async iterator of
    RequestOutputs; leaving it early (break, cancellation, a client gone) aborts the request."""

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: Sequence[StatLogger] = (),
        client: EngineCoreClient | None = None,
    ) -> None:
        self.config = config
        # The core loads the model while this process loads the tokenizer (`client`: a core
        # started earlier still, to load while this process imported the server).
        self.client = client if client is not None else EngineCoreClient(config)
        try:
            self.tokenizer = (
                None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer_source)
            )
        except BaseException:
            self.client.shutdown()
            raise
        eos, extra_eos = config.eos_token_ids(
            self.tokenizer.eos_token_id if self.tokenizer is not None else None
        )
        self.eos_token_id = eos
        self.processor = OutputProcessor(self.tokenizer, eos, extra_eos)
        self.stat_loggers = list(stat_loggers)
        self.max_model_len = config.scheduler.max_model_len
        self.vocab_size = config.model_config.vocab_size
        # The generation config's sampling defaults, for the fields requests leave unset.
        self.default_sampling_params = config.sampling_defaults()
        self.scheduler_stats: SchedulerStats | None = None
        self.ready: CoreReady | None = None
        self.dead_error: EngineDeadError | None = None
        self._collectors: dict[str, _OutputCollector] = {}
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._num_requests_sent = 0  # AddRequests sent to the core, ever
        self._output_task: asyncio.Task | None = None
        self._death_callbacks: list = []
        self._shutting_down = False

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        stat_loggers: Sequence[StatLogger] = (),
        ready_timeout: float = 600.0,
        client: EngineCoreClient | None = None,
    ) -> AsyncLLM:
        """Start the engine core (or take `client`'s); return once it has loaded the model."""
        engine = cls(config, stat_loggers, client)
        try:
            engine.ready = await engine.client.wait_ready(ready_timeout)
        except BaseException:
            engine.client.shutdown()
            raise
        engine.max_model_len = engine.ready.max_model_len
        engine._output_task = asyncio.create_task(engine._output_loop())
        engine.client.watch_death(engine._on_core_exit)
        return engine

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self._shutting_down

    @property
    def num_waiting(self) -> int:
        """Requests queued in the core, counting those sent since its last report."""
        if self.scheduler_stats is None:
            return self._num_requests_sent
        in_flight = self._num_requests_sent - self.scheduler_stats.num_requests_received
        return self.scheduler_stats.num_waiting + in_flight

    def on_death(self, callback) -> None:
        """Call `callback(error)` once if the engine core dies."""
        self._death_callbacks.append(callback)

    # -- requests ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: send token ids")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """ValueError with the numbers for a prompt that cannot run (nothing is queued)."""
        num_prompt_tokens = len(prompt_token_ids)
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary: ids must be in "
                f"[0, {self.vocab_size})"
            )
        requested = num_prompt_tokens + (max_tokens or 0)
        if num_prompt_tokens >= self.max_model_len or requested > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{max_tokens or 0} for the completion). Please reduce the length of the prompt "
                "or the completion."
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt: str | None = None,
        output_kind: OutputKind | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
    ) -> RequestStream:
        """Queue a request now (it counts as waiting from this call on, so an admission check
        right before it holds under a burst) and return its outputs' stream. Raises ValueError
        for a request that cannot run. `kv_transfer_params`: disaggregation (vLLM's field)."""
        if kv_transfer_params is not None and sampling_params.n != 1:
            raise ValueError("kv_transfer_params needs n=1: the first token is one sequence's")
        if self.dead_error is not None:
            raise self.dead_error
        if self._shutting_down:
            raise EngineDeadError("the engine is shutting down")
        output_kind = sampling_params.output_kind if output_kind is None else output_kind
        prompt_token_ids = sampling_params.truncate_prompt(prompt_token_ids, self.max_model_len)
        self.check_prompt(prompt_token_ids, sampling_params.max_tokens)
        sampling_params = self.config.request_params(sampling_params)
        sampling_params.check_vocab(self.vocab_size)
        arrival_time = time.monotonic()
        core_requests = self.processor.add_request(
            request_id,
            prompt_token_ids,
            sampling_params,
            prompt,
            output_kind,
            arrival_time,
            cache_salt,
        )
        collector = _OutputCollector(output_kind)
        self._collectors[request_id] = collector
        for request in core_requests:
            self.client.send(
                AddRequest(
                    request.request_id,
                    request.prompt_token_ids,
                    request.sampling_params,
                    request.eos_token_id,
                    arrival_time,
                    cache_salt,
                    priority,
                    kv_transfer_params,
                )
            )
        self._num_requests_sent += len(core_requests)
        return RequestStream(self, request_id, collector)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt: str | None = None,
        output_kind: OutputKind | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        kv_transfer_params: dict | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request and yield its outputs (as sampling_params.output_kind says, unless
        `output_kind` is given) until it finishes. Raises ValueError for a request that cannot
        run, EngineDeadError if the core dies meanwhile."""
        stream = self.add_request(
            prompt_token_ids,
            sampling_params,
            request_id,
            prompt=prompt,
            output_kind=output_kind,
            cache_salt=cache_salt,
            priority=priority,
            kv_transfer_params=kv_transfer_params,
        )
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def beam_search(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> list[BeamSearchSequence]:
        """vLLM's beam search behind the server (as its EngineClient.beam_search): each step
        queues every live beam as a one-token request (ids `request_id`-step-beam; the prefix
        cache makes the repeated prompts cheap) and waits for them all. The best beams, best
        first, with their tokens (the prompt's included). Cancelling it aborts the step's
        requests. Raises ValueError for a search the server cannot run."""
        search = BeamSearch([prompt_token_ids], params, self.eos_token_id, self.max_model_len)
        self.config.check_logprobs(search.step_params)
        while live := search.live():
            streams: list[RequestStream] = []
            try:
                for index, (_, beam) in enumerate(live):
                    beam_id = f"{request_id}-{search.num_steps}-{index}"
                    stream = self.add_request(
                        beam.tokens, search.step_params, beam_id,
                        output_kind=OutputKind.FINAL_ONLY, cache_salt=cache_salt,
                        priority=priority,
                    )  # fmt: skip
                    streams.append(stream)
                outputs = await asyncio.gather(*(_last_output(stream) for stream in streams))
            finally:
                for stream in streams:
                    stream.cancel()
            search.extend(live, [first_row(output) for output in outputs])
        return search.results()[0]

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        self._collectors.pop(request_id, None)
        finished = self.processor.abort_request(request_id)
        if finished and self.dead_error is None:
            self.client.send(AbortRequests([f.request_id for f in finished]))
        for record in finished:
            for stat_logger in self.stat_loggers:
                stat_logger.record_finished(record)

    # -- the engine core's messages -------------------------------------------------------

    async def _output_loop(self) -> None:
        try:
            while True:
                message = await self.client.recv()
                if isinstance(message, CoreOutputs):
                    self._handle_outputs(message)
                elif isinstance(message, UtilityResult):
                    future = self._utility_calls.pop(message.call_id, None)
                    if future is not None and not future.done():
                        if message.error is not None:
                            future.set_exception(RuntimeError(message.error))
                        else:
                            future.set_result(message.result)
                elif isinstance(message, CoreFailed):
                    self._fail(EngineDeadError(f"the engine core failed: {message.message}"))
                    return
        except asyncio.CancelledError:
            raise
        except EngineDeadError as error:  # the core exited: its output closed
            if not self._shutting_down:
                self._fail(error)
        except Exception as error:  # a bug here must not leave every client hanging
            logger.exception("output loop failed")
            self._fail(EngineDeadError(f"the API process's output loop failed: {error}"))

    def _handle_outputs(self, message: CoreOutputs) -> None:
        processed = self.processor.process_outputs(message.outputs)
        for output in processed.request_outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
                if output.finished:
                    del self._collectors[output.request_id]
        if processed.stopped:
            self.client.send(AbortRequests([sequence_id for sequence_id, _ in processed.stopped]))
        for error in message.errors:
            request_id = self._owner_of(error.request_id)
            collector = self._collectors.pop(request_id, None)
            self._abort(request_id)
            if collector is not None:
                collector.put_error(RequestRefusedError(error.message))
        self.scheduler_stats = message.scheduler_stats
        if message.written_ack:
            # After the woken streams' writes, as the stats below: the core waits for it.
            asyncio.get_running_loop().call_soon(
                self.client.send, OutputsWritten(message.written_ack)
            )
        if self.stat_loggers:
            # After the streams this message woke have written their chunks (call_soon runs in
            # order, and their wake-ups were queued above): a finished request's record
            # observes every gap it lived through, ~70 us for 128 tokens, and when a batch
            # finishes together that held up every stream's last token by milliseconds.
            asyncio.get_running_loop().call_soon(self._record_stats, message, processed.finished)

    def _record_stats(self, message: CoreOutputs, finished: list[FinishedRequestStats]) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record_steps(message.scheduler_stats, message.steps)
            for record in finished:
                stat_logger.record_finished(record)

    def _owner_of(self, sequence_id: str) -> str:
        """The request id of a core sequence id ('{index}_{request_id}' when n > 1)."""
        if sequence_id in self.processor.requests:
            return sequence_id
        _, _, request_id = sequence_id.partition("_")
        return request_id

    def _on_core_exit(self) -> None:
        if not self._shutting_down:
            code = self.client.process.exitcode
            self._fail(EngineDeadError(f"the engine core process exited with code {code}"))

    def _fail(self, error: EngineDeadError) -> None:
        """Every waiting request ends with the error; callbacks learn the engine is dead."""
        if self.dead_error is not None:
            return
        self.dead_error = error
        logger.error("%s", error)
        for collector in self._collectors.values():
            collector.put_error(error)
        self._collectors.clear()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        for callback in self._death_callbacks:
            callback(error)

    # -- utilities --------------------------------------------------------------------------

    async def _call(self, method: str, *args, timeout: float = 30.0):
        if self.dead_error is not None:
            raise self.dead_error
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self.client.send(UtilityCall(call_id, method, list(args)))
        return await asyncio.wait_for(future, timeout)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The core's state now (round trip), not as of its last step."""
        return SchedulerStats(**await self._call("scheduler_stats"))

    async def shutdown(self) -> None:
        self._shutting_down = True
        if self._output_task is not None:
            self._output_task.cancel()
            await asyncio.gather(self._output_task, return_exceptions=True)
        self.client.shutdown()  # blocks for at most a few seconds: the server is stopping
