"""The engine core: token ids in, token ids out. One step = schedule → forward → sample →
update. It owns the scheduler, the KV cache manager, the model runner and the sampler; text,
stop strings and n > 1 live in the front end (llm_engine.py)."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.outputs import EngineCoreOutput, StepUpdate, core_output
from tandem.core.roofline import BatchSums, ModelShape, StepWork, place_step, sums_work
from tandem.core.scheduler import Scheduler, SchedulerOutput, all_greedy
from tandem.core.spec_stats import SpecDecodeStats
from tandem.core.step_cost import StepCostModel
from tandem.engine.machine_peaks import machine_peaks
from tandem.engine.stats import SchedulerStats, StepStats
from tandem.engine.structured_outputs import StructuredOutputs
from tandem.kv_transfer.params import (
    KVLoad,
    RemotePrefill,
    RemoteStream,
    check_first_token,
    check_kv_transfer,
    first_logprobs_row,
)
from tandem.outputs import Logprob
from tandem.request import Request, RequestStatus
from tandem.sampling_params import num_top_logprobs
from tandem.spec_decode.draft_model import DraftModelProposer
from tandem.spec_decode.ngram import NgramProposer, Proposer
from tandem.worker.cpu_threads import ForwardThreads, process_run_delay
from tandem.worker.inference_mode import inference_mode
from tandem.worker.logits_processors import reads_output_tokens
from tandem.worker.model_runner import ModelRunner
from tandem.worker.rejection_sampler import verify
from tandem.worker.sampler import (
    LogprobsTensors,
    SamplerOutput,
    SamplingInputs,
    argmax_only,
    burst_draws,
    logprob_dicts,
    plain_sampling,
    sample,
)

if TYPE_CHECKING:
    from tandem.attention.metadata import BatchInputs
    from tandem.core.scheduler import ScheduledRequest
    from tandem.engine.config import EngineConfig
    from tandem.kv_transfer.receiver import LoadResult

logger = logging.getLogger(__name__)

RETRY_DECLINED_EVERY = 8
# With async scheduling two threads run Python: the one holding the GIL keeps it up to the
# switch interval (5 ms by default) while the other waits, which is a whole step of a small
# model. Switching every 0.1 ms lets the executor launch its step while this thread plans.
ASYNC_SWITCH_INTERVAL = 0.0001
# Steps whose telemetry waits to be worked out together (see EngineCore._record_stats).
TELEMETRY_BATCH = 16


@dataclass
class _InFlightStep:
    """A step whose forward and sampling run on the executor thread while the next step is
    scheduled and prepared (async scheduling)."""

    scheduled: SchedulerOutput
    requests: list[Request]  # the sampling requests, in the order of their rows
    row_of: dict[str, int]  # request id -> row of its sampled token
    result: Future[_StepResult]
    start: float  # when it was scheduled (perf_counter)
    # Set by the executor as it starts the forward: this thread waits for it before its own
    # work, so that the executor's few steps between two forwards do not wait for the GIL.
    started: threading.Event


@dataclass
class _StepResult:
    sampled: SamplerOutput  # token ids on the device: the next step's placeholders read them
    host_token_ids: torch.Tensor  # their copy in host memory, complete once `ready` is
    ready: torch.cuda.Event | None  # None where the device's work is done when calls return


def restore_generator(generator: torch.Generator, state: str) -> None:
    """Put a generator where another instance's was (base64 of get_state())."""
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))


def runner_shape(runner: ModelRunner) -> ModelShape:
    """The runner's model as its step's roofline counts it: weights, KV and activations in
    the runner's dtypes, and what it keeps packed."""
    element_bytes = torch.empty((), dtype=runner.dtype).element_size()
    kv_bytes = torch.empty((), dtype=runner.kv_cache_dtype).element_size()
    return ModelShape.of(
        runner.model_config, element_bytes, kv_bytes, element_bytes, runner.packed_weights()
    )


def _no_guesses(requests: list[Request]) -> float:
    """A step that guesses nothing: the requests' old guesses go (no backlog paid: 0 s)."""
    for request in requests:
        request.spec_token_ids = ()
    return 0.0


def set_random_seed(seed: int) -> None:
    """vLLM's global seed: random, numpy and torch (every device) in this process. Requests
    without a seed of their own draw from torch's default generator, so a run repeats."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class EngineCore:
    def __init__(self, config: EngineConfig, max_step_stats: int = 100_000) -> None:
        self.config = config
        runner_config, scheduler_config = config.runner, config.scheduler
        if config.seed is not None:
            set_random_seed(config.seed)
        self.runner = ModelRunner(runner_config)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            runner_config.block_size,
            config.enable_prefix_caching,
            config.prefix_caching_hash_algo,
        )
        self._init_telemetry(config)
        self.cost_model = StepCostModel(self.model_shape, self.peaks)
        if scheduler_config.num_scheduler_steps > 1:
            max_rows = self.runner.max_burst_rows
            if max_rows == 0:
                logger.info(
                    "num_scheduler_steps=%d: one forward per step here (several need the "
                    "CPU's fused decode step: every matrix packed, the LM head too, the cpu "
                    "attention backend)", scheduler_config.num_scheduler_steps,
                )  # fmt: skip
            scheduler_config = dataclasses.replace(
                scheduler_config,
                num_scheduler_steps=scheduler_config.num_scheduler_steps if max_rows else 1,
                multi_step_max_seqs=max(max_rows, 1),
            )
        self.scheduler = Scheduler(
            scheduler_config, self.kv_cache_manager, cost_model=self.cost_model
        )
        self.generators: dict[str, torch.Generator] = {}
        self.proposer = self._make_proposer(config)
        if self.proposer is not None and self.proposer.costly:
            # A draft model's exploring guess would first catch up on every token since its
            # last one (core/spec_guard.py).
            self.scheduler.speculation_guard.explores_refusals = False
        # Steps in a row whose guesses the scheduler verified none of, or that the proposer's
        # forecast refused (a costly proposer then asks only every RETRY_DECLINED_EVERY steps).
        self.num_declined_proposals = 0
        # Requests still owed prompt logprobs -> prompt positions whose logits have been scored
        # and sent (the logits at position p give the logprob of prompt token p + 1). A request
        # leaves once all are sent, so a recompute after a preemption never sends them again
        # and decode steps do not look at it.
        self.prompt_logprobs_sent: dict[str, int] = {}
        self._step_stats: deque[StepStats] = deque(maxlen=max_step_stats)
        # Steps recorded but whose roofline and forecast are not yet worked out: each a
        # StepStats to complete, its sums, its proposer's seconds, its wall-clock time.
        self._unfinished_stats: list[tuple[StepStats, BatchSums, float, float]] = []
        # The scheduler forecasts steps from the cost model (an ITL target, or adaptive
        # speculation, which weighs drafts by their cost): it learns from each step at once;
        # with speculation alone, only before steps its guard lets verify drafts.
        self._telemetry_each_step = scheduler_config.target_step_time is not None
        self._telemetry_before_drafts = (
            self.proposer is not None and scheduler_config.adaptive_speculation
        )
        self._num_stats_finished = 0  # steps whose telemetry is in _step_stats
        self._num_stats_taken = 0  # of those, the ones take_finished_stats returned
        self.num_prefill_tokens = 0  # computed since start
        self.num_decode_tokens = 0
        self._init_async_scheduling(config)
        self.forward_threads = None
        if config.adapt_cpu_threads and self.runner.device.type == "cpu":
            threads = torch.get_num_threads()
            if threads > 1 and process_run_delay() is not None:
                self.forward_threads = ForwardThreads(threads)
        self.kv_connector = None
        if config.kv_transfer is not None:
            from tandem.kv_transfer.connector import KVConnector  # zmq: server extras only

            self.kv_connector = KVConnector(config.kv_transfer, self.runner.kv_caches)
        # Outputs made outside a step (a decode instance's first tokens, which arrive with
        # their requests), returned by the next step().
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_requests_received = 0
        max_tokens = self.kv_cache_manager.max_num_tokens
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens; max concurrency at max_model_len=%d: "
            "%.2fx",
            self.runner.num_kv_blocks,
            runner_config.block_size,
            max_tokens,
            scheduler_config.max_model_len,
            max_tokens / scheduler_config.max_model_len,
        )

    def _init_async_scheduling(self, config: EngineConfig) -> None:
        """Async scheduling runs each step's forward and sampling on one executor thread
        while this thread schedules and prepares the next step and turns the previous one's
        tokens into outputs; step() then returns the outputs of the step before the one it
        launched."""
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling and self.proposer is not None:
            raise ValueError("async scheduling cannot verify drafts: the tokens in flight decide")
        self._executor = None
        if self.async_scheduling:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-step")
            sys.setswitchinterval(min(sys.getswitchinterval(), ASYNC_SWITCH_INTERVAL))
            logger.info("async scheduling: on (the next step is planned while one runs)")
        self._in_flight: _InFlightStep | None = None
        self._last_completion = 0.0
        # Requests whose sampling reads their own output tokens (penalties, bad words): while
        # any is unfinished, steps run one at a time, as the tokens in flight would be missing.
        self._sync_request_ids: set[str] = set()
        # Requests with fewer output tokens than their min_tokens: EOS and stop ids are
        # blocked for them. Usually none, and then sampling does not look at each request.
        self._min_tokens_ids: set[str] = set()
        # Unfinished requests that are not argmax_only, and those that are not plain_sampling:
        # with none, every step's rows are plain greedy (plain) without a look at each request.
        self._not_argmax_ids: set[str] = set()
        self._not_plain_ids: set[str] = set()
        # Requests held to a grammar (structured outputs), and their matchers.
        self.structured = StructuredOutputs(
            None if config.skip_tokenizer_init else config.tokenizer_source,
            self.runner.model_config.vocab_size,
        )

    @property
    def spec_decode_stats(self) -> SpecDecodeStats:
        return self.scheduler.spec_decode_stats

    def _make_proposer(self, config: EngineConfig) -> Proposer | None:
        speculative = config.speculative
        if speculative is None:
            return None
        if config.draft_runner is None:
            return NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        draft_config = dataclasses.replace(
            config.draft_runner, num_kv_blocks=self.runner.num_kv_blocks
        )
        draft = ModelRunner(draft_config)
        peaks = machine_peaks(
            draft.device, draft.dtype, config.peak_tflops, config.peak_bandwidth_gbps
        )
        cost_model = StepCostModel(runner_shape(draft), peaks)
        return DraftModelProposer(
            draft, self.kv_cache_manager, cost_model, speculative.num_speculative_tokens
        )

    def _init_telemetry(self, config: EngineConfig) -> None:
        """The model's shape and the machine's peaks for each step's roofline, and the step
        log."""
        self.model_shape = runner_shape(self.runner)
        self.peaks = machine_peaks(
            self.runner.device, self.runner.dtype, config.peak_tflops, config.peak_bandwidth_gbps
        )
        logger.info(
            "machine peaks: %s: %.2f TFLOP/s (%s), %.1f GB/s; ridge point %.1f FLOP/byte",
            self.peaks.name,
            self.peaks.flops_per_second / 1e12,
            str(self.runner.dtype).removeprefix("torch."),
            self.peaks.bytes_per_second / 1e9,
            self.peaks.ridge_point,
        )
        # Open for the engine's life, a line at a time: a reader sees each step once its
        # telemetry is worked out (see _record_stats), every step once the engine idles.
        self.step_log = (
            None if config.step_log is None else open(config.step_log, "a", buffering=1)  # noqa: SIM115
        )

    def add_request(
        self, request: Request, kv_transfer_params: dict[str, Any] | None = None
    ) -> None:
        """Queue a request; ValueError (nothing queued) for one that cannot run.
        `kv_transfer_params` (disaggregation): {"do_remote_decode": true} (and a transfer id,
        to stream) on a prefill instance; on a decode instance, what a prefill instance
        returned, or the endpoint and transfer id of a prefill leg running now."""
        self.num_requests_received += 1
        vocab_size = self.runner.model_config.vocab_size
        request.sampling_params.check_vocab(vocab_size)
        self.config.check_logprobs(request.sampling_params)
        request.argmax_only = argmax_only(request.sampling_params)
        request.plain_sampling = plain_sampling(request.sampling_params)
        structured = request.sampling_params.structured_outputs
        if structured is not None and self.proposer is not None:
            raise ValueError(
                "structured_outputs with speculative decoding is not supported yet: the drafts "
                "would be verified without the grammar; start the engine without a "
                "speculative_config to use them"
            )
        remote = None
        connector = self.kv_connector
        # A request id already streaming is another request's (this one is refused below).
        streamed_before = connector is not None and request.request_id in connector.streaming
        if kv_transfer_params is not None:
            if connector is not None:
                remote = connector.accept(request, kv_transfer_params, vocab_size)
            else:
                check_kv_transfer(
                    kv_transfer_params, "both", request.prompt_token_ids, request.sampling_params,
                    self.config.runner.block_size, vocab_size,
                )  # fmt: skip
        first_known = isinstance(remote, RemotePrefill)
        if first_known:
            logprobs_by_id = self._take_first_token(request, remote)
            status = self.scheduler.stop_status(request)
            if status is not None:  # it ends at its first token: nothing to pull
                request.status, request.finished_time = status, request.first_token_time
                self.kv_connector.release(remote)
                self._pending_outputs.append(self._output(request, 0, logprobs_by_id))
                return
        request.remote_prefill = remote
        try:
            if structured is not None:  # compiled first: a bad grammar queues nothing
                self.structured.add(request.request_id, structured, request.eos_token_id)
            self.scheduler.add_request(request)
        except ValueError:
            self.structured.forget(request.request_id)
            if remote is not None:  # its KV will never be pulled
                connector.release(remote)
            if connector is not None and not streamed_before:
                connector.drop_stream(request.request_id)
            raise
        seed = request.sampling_params.seed
        if seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(seed)
            if first_known and remote.generator_state is not None:
                restore_generator(generator, remote.generator_state)
            self.generators[request.request_id] = generator
        if first_known:
            self._pending_outputs.append(self._output(request, 0, logprobs_by_id))
        if request.sampling_params.prompt_logprobs is not None and request.num_prompt_tokens > 1:
            self.prompt_logprobs_sent[request.request_id] = 0
        if self.async_scheduling and reads_output_tokens(request.sampling_params):
            self._sync_request_ids.add(request.request_id)
        if request.sampling_params.min_tokens > request.num_output_tokens:
            self._min_tokens_ids.add(request.request_id)
        if not request.argmax_only:
            self._not_argmax_ids.add(request.request_id)
        if not request.plain_sampling:
            self._not_plain_ids.add(request.request_id)

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, stop_reason: str | None = None
    ) -> None:
        """End requests from outside: aborts, or stop strings found in the detokenized text."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and stop_reason is not None:
                request.stop_reason = stop_reason
            remote = None if request is None else request.remote_prefill
            if remote is not None and (
                request_id not in self.scheduler.receiving or remote.transfer_id is not None
            ):  # still queued: its KV will never be pulled (a pull under way frees it; a
                # stream under way is ended, as it may wait long for the prompt's chunks)
                self.kv_connector.release(remote)
            if self.kv_connector is not None:
                self.kv_connector.drop_stream(request_id)
            self._forget_sampling(request_id)
            self.prompt_logprobs_sent.pop(request_id, None)
            if self.proposer is not None:
                self.proposer.forget(request_id)
        self.scheduler.finish_requests(request_ids, status)
        if self._unfinished_stats and not self.scheduler.has_schedulable_requests():
            self.finish_stats()  # idle now: the step log gets every step

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or a step in flight to land (async scheduling), or outputs to
        return."""
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self._pending_outputs)
        )

    def has_work(self) -> bool:
        """Whether step() would do anything now: not while the only requests wait for their
        KV to arrive (the core's loop then blocks until a transfer wakes it)."""
        return (
            self.scheduler.has_schedulable_requests()
            or self._in_flight is not None
            or bool(self._pending_outputs)
        )

    def step(self) -> list[EngineCoreOutput]:
        """Run a step and return what requests got from it; with async scheduling, launch a
        step and return what the step launched before it produced. Outputs known before any
        step (a decode instance's first tokens, from the prefill instance) are returned at
        once, without a step: a client waits for no one's forward to see them."""
        if self.kv_connector is not None:
            self.poll_kv_transfers()
        if self._pending_outputs:
            outputs, self._pending_outputs = self._pending_outputs, []
            return outputs
        return self._step_outputs()

    def _step_outputs(self) -> list[EngineCoreOutput]:
        if self._executor is None:
            return self._step()
        in_flight = self._in_flight
        if self.prompt_logprobs_sent or self._sync_request_ids:
            # Their inputs depend on the tokens in flight: land those, then step one at a time.
            if in_flight is not None:
                self._in_flight = None
                return self._complete(in_flight)
            return self._step()
        start = time.perf_counter()
        scheduled = self._schedule()
        launched = self._launch(scheduled, in_flight, start) if scheduled.scheduled else None
        self._in_flight = launched
        return [] if in_flight is None else self._complete(in_flight, launched)

    def _schedule(self) -> SchedulerOutput:
        scheduled = self.scheduler.schedule()
        if scheduled.kv_loads:
            self._start_kv_loads(scheduled.kv_loads)
        return scheduled

    # -- disaggregation -----------------------------------------------------------------------

    def poll_kv_transfers(self) -> None:
        """Land what the transfer threads finished: a prefill instance frees the blocks that
        were sent (or released, or held too long); a decode instance lets the requests whose
        KV arrived decode, and prefills here those whose pull failed."""
        connector = self.kv_connector
        assert connector is not None
        for request_id in connector.take_released():
            self.scheduler.release_detached(request_id)
        for result in connector.take_results():
            request = self.scheduler.receiving.get(result.request_id)
            if request is not None and isinstance(request.remote_prefill, RemoteStream):
                self._land_stream(request, result)
            else:
                self.scheduler.finish_kv_load(result.request_id, result.ok)

    def _take_first_token(
        self, request: Request, remote: RemotePrefill
    ) -> dict[str, list[dict[int, Logprob]]]:
        """Record the first token the prefill instance sampled; its logprobs by request id."""
        request.append_output_token_ids([remote.first_token_id])
        now = self.scheduler.clock()
        request.first_scheduled_time = request.first_token_time = request.last_token_time = now
        request.num_cached_tokens = remote.num_cached_tokens
        first_row = first_logprobs_row(remote.first_logprobs)
        return {} if first_row is None else {request.request_id: [first_row]}

    def _land_stream(self, request: Request, result: LoadResult) -> None:
        """A stream's end: the prompt's KV is here and, with it, the first token (decoding
        goes on from the next step), or the stream failed and the prompt is computed here."""
        remote = None
        if result.ok:
            params = request.sampling_params
            try:
                remote = RemotePrefill.from_dict(result.final)
                check_first_token(
                    remote, request.prompt_token_ids, params.logprobs is not None,
                    self.config.runner.block_size, self.runner.model_config.vocab_size,
                )  # fmt: skip
            except (ValueError, TypeError) as error:
                logger.warning("stream of request %s ended unusable (%s): prefilling it here",
                               request.request_id, error)  # fmt: skip
                self.kv_connector.count_failed_landing(result)
                remote = None
        request_id = request.request_id
        if remote is None:
            self.scheduler.finish_kv_load(request_id, False)
            return
        request.remote_prefill = remote
        logprobs_by_id = self._take_first_token(request, remote)
        self.scheduler.finish_kv_load(request_id, True)
        generator = self.generators.get(request_id)
        if generator is not None and remote.generator_state is not None:
            restore_generator(generator, remote.generator_state)
        status = self.scheduler.stop_status(request)
        if status is not None:
            self.finish_requests([request_id], status)
        self._pending_outputs.append(self._output(request, 0, logprobs_by_id))

    def _start_kv_loads(self, loads: list[KVLoad]) -> None:
        assert self.kv_connector is not None
        for load in self.kv_connector.start(loads):
            self.scheduler.finish_kv_load(load.request_id, True)

    def _launch(
        self, scheduled: SchedulerOutput, previous: _InFlightStep | None, start: float
    ) -> _InFlightStep:
        """Prepare a step here and hand its forward and sampling to the executor. Tokens the
        previous step is still sampling are placeholders in the batch: the executor fills
        them in from that step's sampled ids (on the device) before the forward."""
        entries = scheduled.scheduled
        requests = scheduled.sampling_requests()
        batch = self.runner.prepare(entries, [s.sample for s in entries])
        inputs = self._sampling_inputs(requests)
        fill_rows = None
        if batch.placeholder_requests_cpu is not None:
            if previous is None:
                raise RuntimeError("placeholder tokens with no step in flight to fill them in")
            rows = [
                previous.row_of[entries[index].request_id]
                for index in batch.placeholder_requests_cpu.tolist()
            ]
            fill_rows = torch.tensor(rows, device=self.runner.device)
        self.scheduler.mark_in_flight(scheduled)
        started = threading.Event()
        result = self._executor.submit(
            self._execute, batch, inputs, None if fill_rows is None else previous.result,
            fill_rows, started,
        )  # fmt: skip
        row_of = {request.request_id: row for row, request in enumerate(requests)}
        return _InFlightStep(scheduled, requests, row_of, result, start, started)

    @inference_mode
    def _execute(
        self,
        batch: BatchInputs,
        inputs: SamplingInputs,
        previous: Future[_StepResult] | None,
        fill_rows: torch.Tensor | None,
        started: threading.Event,
    ) -> _StepResult:
        """The executor's half of a step: forward and sampling. The previous step ran on the
        same thread before it, so its sampled ids are there. On CUDA the ids are copied to
        the host behind an event, before the next step's kernels are queued, so waiting for
        them does not wait for that step too."""
        placeholder_ids = None
        try:
            if previous is not None:
                placeholder_ids = previous.result().sampled.token_ids[fill_rows]
        finally:
            started.set()  # also when failing: the caller waits for it
        run = self.runner.forward(batch, placeholder_token_ids=placeholder_ids)
        sampled = sample(run.logits, inputs)
        host = self.runner.to_host(sampled.token_ids)
        return _StepResult(sampled, host, self.runner.completion_event())

    def _complete(
        self, in_flight: _InFlightStep, launched: _InFlightStep | None = None
    ) -> list[EngineCoreOutput]:
        """Wait for a step in flight and record its tokens; its outputs. `launched`: the step
        launched after it, which the executor takes up first."""
        if launched is not None:
            # Its forward starts once this step's work is done: wake up then, not in between.
            launched.started.wait()
        result = in_flight.result.result()
        if result.ready is not None:
            result.ready.synchronize()
        output = result.sampled
        requests = in_flight.requests
        sampled = result.host_token_ids.tolist()  # one per sampling request, in order
        logprobs_by_id = {}
        if output.logprobs is not None:
            logprobs_by_id = {
                r.request_id: [row]
                for r, row in zip(requests, output.logprobs, strict=True)
                if row is not None
            }
        update = self.scheduler.settle_in_flight(in_flight.scheduled, sampled, logprobs_by_id)
        outputs = self._finish_outputs(update, logprobs_by_id)
        if self.kv_connector is not None and self.kv_connector.streaming:
            self._stage_streams(in_flight.scheduled.scheduled)
        now = time.perf_counter()
        step_time = now - max(in_flight.start, self._last_completion)
        self._last_completion = now
        self._record_stats(in_flight.scheduled, step_time, 0, 0.0)
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        scheduled = self._schedule()
        if not scheduled.scheduled:
            return []
        entries = scheduled.scheduled
        sampled_requests = scheduled.sampling_requests()
        prompt_ranges, num_prompt_top = self._prompt_logits_ranges(entries)
        drafts = None
        if scheduled.num_draft_tokens:
            drafts = [s.draft_token_ids for s in entries]
        # Mostly every request samples (a decode step): no mask to build then.
        sample_mask = None
        if len(sampled_requests) < len(entries):
            sample_mask = [s.sample for s in entries]
        # One greedy row and nothing else sampled (a batch-1 decode): the LM head's kernel may
        # find its argmax as it writes the logits, instead of a pass over them after.
        argmax = (
            len(sampled_requests) == 1
            and sample_mask is None
            and drafts is None
            and sampled_requests[0].argmax_only
            and not self._min_tokens_ids
        )
        num_steps = scheduled.num_steps
        if num_steps > 1:  # multi-step: the decodes' forwards, one after another
            sampled = self._decode_steps(entries, sampled_requests, num_steps)
            logprobs_by_id, prompt_logprobs = {}, None
            num_steps = len(sampled[0])  # fewer where a stop token ended them
        else:
            run = self.runner.run(
                entries, sample_mask, prompt_ranges, num_prompt_top, drafts, argmax
            )
            if run.argmax is not None:
                sampled = run.argmax.tolist()
                logprobs_by_id = {}
            else:
                sampled, logprobs_by_id = self._sample(run.logits, sampled_requests, scheduled)
            prompt_logprobs = run.prompt_logprobs
        prompt_logprobs_by_id = self._prompt_logprobs(entries, prompt_ranges, prompt_logprobs)
        update = self.scheduler.update_from_output(scheduled, sampled, logprobs_by_id)
        outputs = self._finish_outputs(update, logprobs_by_id)
        num_accepted = 0 if drafts is None else sum(map(len, sampled)) - len(sampled)
        if self.kv_connector is not None and self.kv_connector.streaming:
            self._stage_streams(entries)
        if self.proposer is not None:
            for request_id in scheduled.preempted_request_ids:
                self.proposer.forget(request_id)  # its KV is gone, the draft's too
            propose_start = time.perf_counter()
            catch_up_time = self._propose(update.requests, scheduled.num_draft_tokens)
            propose_time = time.perf_counter() - propose_start
        else:
            propose_time = catch_up_time = 0.0
        if prompt_logprobs_by_id:
            outputs = self._with_prompt_logprobs(outputs, prompt_logprobs_by_id)
        self._record_stats(
            scheduled, time.perf_counter() - start, num_accepted, propose_time, num_steps,
            catch_up_time,
        )  # fmt: skip
        return outputs

    def _decode_steps(
        self, entries: list[ScheduledRequest], requests: list[Request], num_steps: int
    ) -> list[list[int]]:
        """A multi-step burst's tokens, per request. Random requests' draws are taken up front
        (sampler.burst_draws); where a stop token ends the burst early, every generator is put
        back where that many single steps would have left it."""
        stops = [request.stop_check_ids for request in requests]
        if all(request.argmax_only for request in requests):
            return self.runner.decode_steps(entries, num_steps, stops)
        draws = burst_draws(
            [request.sampling_params for request in requests],
            [self.generators.get(request.request_id) for request in requests],
            num_steps, self.runner.model_config.vocab_size,
        )  # fmt: skip
        tokens = self.runner.decode_steps(entries, num_steps, stops, draws)
        if len(tokens[0]) < num_steps:
            draws.give_back(len(tokens[0]))
        return tokens

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], scheduled: SchedulerOutput
    ) -> tuple[list[int] | list[list[int]], dict[str, list[dict[int, Logprob]]]]:
        """The tokens each sampling request gets from the step, in order (as
        Scheduler.update_from_output takes them): with no drafts in the step, one token each;
        with drafts, a list each (accepted drafts and one more); and their logprob dicts for
        the requests that asked. Requests without drafts sample as in any step (their seeded
        draws do not depend on whether a batch mate speculates); the others are verified."""
        inputs = self._sampling_inputs(requests)
        if not scheduled.num_draft_tokens:
            output = sample(logits, inputs)
            if output.logprobs is None:
                return output.token_ids.tolist(), {}
            rows = zip(requests, output.logprobs, strict=True)
            logprobs = {r.request_id: [row] for r, row in rows if row is not None}
            return output.token_ids.tolist(), logprobs
        ids = [r.request_id for r in requests]
        drafts = [s.draft_token_ids for s in scheduled.scheduled if s.sample]
        plain = [i for i, d in enumerate(drafts) if not d]
        speculative = [i for i, d in enumerate(drafts) if d]
        first_rows = np.cumsum([0] + [1 + len(d) for d in drafts])
        sampled: list[list[int]] = [[] for _ in requests]
        logprobs_by_id: dict[str, list[dict[int, Logprob]]] = {}
        if plain:
            if speculative:
                logits_of_plain = logits[torch.as_tensor(first_rows[plain], device=logits.device)]
                output = sample(logits_of_plain, inputs.select(plain))
            else:
                output = sample(logits, inputs)
            rows = output.logprobs or [None] * len(plain)
            for i, token, row in zip(plain, output.token_ids.tolist(), rows, strict=True):
                sampled[i] = [token]
                if row is not None:
                    logprobs_by_id[ids[i]] = [row]
        if speculative:
            rows_of = [np.arange(first_rows[i], first_rows[i + 1]) for i in speculative]
            index = torch.as_tensor(np.concatenate(rows_of), device=logits.device)
            verified = verify(
                logits[index], inputs.select(speculative), [drafts[i] for i in speculative]
            )
            logprobs = verified.logprobs or [None] * len(speculative)
            for i, tokens, rows in zip(speculative, verified.token_ids, logprobs, strict=True):
                sampled[i] = tokens
                if rows is not None:
                    logprobs_by_id[ids[i]] = rows
        return sampled, logprobs_by_id

    def _propose(self, requests: list[Request], num_verified: int) -> float:
        """Guess the next tokens of the requests that got tokens and go on decoding, where
        speculation adapts only if the scheduler's measured check would let the next step
        verify drafts, at the batch size it will have (n-gram lookup's numpy calls took ~0.35 ms
        for 8 requests, ~5% of a batch-8 step on a 2-core CPU, for guesses then dropped).
        A costly proposer (a draft model) guesses only where its forecast cost leaves the
        drafts a gain (`_guesses_may_pay`), and once the scheduler has declined its guesses or
        the forecast refused them, two steps in a row, it asks only every RETRY_DECLINED_EVERY
        steps until the scheduler takes some (asked each step, the forecast cost ~1% of a
        batch-32 step where it kept refusing). Returns the seconds the proposer spent on
        backlogs (paid once)."""
        assert self.proposer is not None
        live = []
        for request in requests:
            if request.is_finished:
                self.proposer.forget(request.request_id)
            else:
                live.append(request)
        adaptive, costly = self.config.scheduler.adaptive_speculation, self.proposer.costly
        if adaptive and (
            (costly and self._proposals_declined(num_verified))
            or not self.scheduler.speculation_guard.peek(
                self.scheduler.num_running, all_greedy(self.scheduler.running)
            )
        ):
            return _no_guesses(live)
        limits = [self.scheduler.max_drafts(r) for r in live]
        if adaptive and costly and not self._guesses_may_pay(live, limits):
            self.num_declined_proposals += 1
            return _no_guesses(live)
        for request, drafts in zip(live, self.proposer.propose(live, limits), strict=True):
            request.spec_token_ids = drafts
        return self.proposer.catch_up_seconds

    def _guesses_may_pay(self, requests: list[Request], limits: list[int]) -> bool:
        """Whether a costly proposer's guesses could pay, by its own cost forecast: each step's
        part, and its backlogs (a new request's prompt, the tokens of steps that verified no
        drafts) spread over the steps the requests have left at the most tokens a step can
        emit. Without this, a draft model exploring at a batch size where it cannot pay (on a
        2-core CPU its batch-32 step costs about the fp32 target's) caught up every request's
        whole context each time: 2.9 s against 48 ms steps. Until both cost models have
        learned a line, it may: the roofline that predicts before then is no forecast."""
        assert self.proposer is not None
        forecast = self.proposer.forecast_seconds(requests, limits)
        if forecast is None or self.cost_model.coefficients is None:
            return True
        steady, once = forecast
        if once > 0:
            remaining = sum(r.length_limit - r.num_tokens for r in requests) / len(requests)
            steady += once / max(1.0, remaining / (1 + max(limits)))
        return self.scheduler.drafts_may_pay(requests, limits, steady)

    def _proposals_declined(self, num_verified: int) -> bool:
        """Whether a costly proposer skips this step: the scheduler declined its guesses, or
        its forecast refused them, two steps in a row, and this is not one of the
        RETRY_DECLINED_EVERY steps that try again."""
        if num_verified:
            self.num_declined_proposals = 0
        elif any(r.spec_token_ids for r in self.scheduler.running):
            self.num_declined_proposals += 1
        return bool(self.num_declined_proposals >= 2 and self.num_steps % RETRY_DECLINED_EVERY)

    # -- prompt logprobs -----------------------------------------------------------------------

    def _prompt_logits_ranges(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[tuple[int, int]] | None, int]:
        """Per scheduled request, the positions [start, end) of this step's tokens whose logits
        give prompt logprobs not sent yet ((0, 0): none), and the most top tokens one of them
        asks for; None when no request has any, which is all a step without them costs. The
        last prompt position is not one (its logits are sampled), and after a preemption
        mid-prompt the positions already sent are not scored again."""
        if not self.prompt_logprobs_sent:
            return None, 0
        ranges = []
        num_top = -1
        for entry in scheduled:
            num_sent = self.prompt_logprobs_sent.get(entry.request_id)
            if num_sent is None:
                ranges.append((0, 0))
                continue
            request = self.scheduler.requests[entry.request_id]
            computed = entry.num_computed_tokens
            start = max(computed, num_sent)
            end = min(computed + entry.num_new_tokens, request.num_prompt_tokens - 1)
            if start >= end:
                ranges.append((0, 0))
                continue
            if start != num_sent:
                raise RuntimeError(
                    f"request {entry.request_id!r} skipped prompt positions {num_sent}..{start} "
                    "(a prefix-cache hit for a request that wants prompt logprobs?)"
                )
            ranges.append((start, end))
            num_top = max(num_top, self._num_prompt_top(request))
        return (ranges, num_top) if num_top >= 0 else (None, 0)

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        ranges: list[tuple[int, int]] | None,
        tensors: LogprobsTensors | None,
    ) -> dict[str, list[dict[int, Logprob]]]:
        """This step's prompt logprob dicts by request id; their positions are marked sent."""
        if ranges is None or tensors is None:
            return {}
        scored = [
            (self.scheduler.requests[e.request_id], end - start)
            for e, (start, end) in zip(scheduled, ranges, strict=True)
            if end
        ]
        num_top = [self._num_prompt_top(r) for r, count in scored for _ in range(count)]
        rows = logprob_dicts(tensors, num_top)
        by_id = {}
        offset = 0
        for request, count in scored:
            request_id = request.request_id
            by_id[request_id] = rows[offset : offset + count]
            offset += count
            num_sent = self.prompt_logprobs_sent[request_id] + count
            if num_sent == request.num_prompt_tokens - 1:
                del self.prompt_logprobs_sent[request_id]  # all sent
            else:
                self.prompt_logprobs_sent[request_id] = num_sent
        return by_id

    def _num_prompt_top(self, request: Request) -> int:
        requested = request.sampling_params.prompt_logprobs
        return num_top_logprobs(requested, self.runner.model_config.vocab_size)

    def _with_prompt_logprobs(
        self, outputs: list[EngineCoreOutput], by_id: dict[str, list[dict[int, Logprob]]]
    ) -> list[EngineCoreOutput]:
        """Attach each request's new prompt logprobs to its output; a prompt chunk that sampled
        nothing gets an output of its own, with no tokens."""
        for output in outputs:
            output.new_prompt_logprobs = by_id.pop(output.request_id, None)
        for request_id, rows in by_id.items():
            request = self.scheduler.requests[request_id]  # it sampled nothing: not finished
            output = self._output(request, request.num_output_tokens, {})
            output.new_prompt_logprobs = rows
            outputs.append(output)
        return outputs

    def _sampling_inputs(self, requests: list[Request]) -> SamplingInputs:
        params = [r.sampling_params for r in requests]
        num_rows = len(requests)
        all_argmax_only = not self._not_argmax_ids or all(r.argmax_only for r in requests)
        if all_argmax_only and not self._min_tokens_ids:
            # Plain greedy rows: the sampler takes the argmax and reads nothing else.
            nothing = [()] * num_rows
            return SamplingInputs(params, nothing, nothing, [None] * num_rows, nothing, True)
        blocked: list[list[int]] = [[]] * num_rows  # shared, never written
        below_min = self._min_tokens_ids
        for row, request in enumerate(requests if below_min else ()):
            request_id = request.request_id
            if request_id not in below_min:
                continue
            request_params = request.sampling_params
            if request_params.min_tokens > len(request.output_token_ids):
                # A grammar allows EOS only where it is complete, and then nothing else.
                held_off = request.eos_token_id is None or request_id in self.structured
                eos = [] if held_off else [request.eos_token_id]
                blocked[row] = eos + request_params.stop_token_ids
            else:
                below_min.discard(request_id)  # output tokens only grow
        generators = self.generators
        return SamplingInputs(
            params=params,
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[generators.get(r.request_id) for r in requests]
            if generators
            else [None] * num_rows,
            stop_token_ids_to_block=blocked,
            all_argmax_only=all_argmax_only,
            all_plain=True if not self._not_plain_ids else None,
            grammar_bitmasks=self._grammar_bitmasks(requests),
        )

    def _grammar_bitmasks(self, requests: list[Request]) -> list[torch.Tensor | None] | None:
        """The rows held to a grammar: the tokens each may take next; None with no such row."""
        structured = self.structured
        if not structured:
            return None
        return [
            structured.bitmask(r.request_id, r.output_token_ids)
            if r.request_id in structured
            else None
            for r in requests
        ]

    def _finish_outputs(
        self, update: StepUpdate, logprobs_by_id: dict[str, list[dict[int, Logprob]]]
    ) -> list[EngineCoreOutput]:
        """The step's outputs (the scheduler built them as it recorded the tokens), each
        finished request's state here forgotten (its KV held on a prefill instance)."""
        for index in update.finished:
            request = update.requests[index]
            rows = logprobs_by_id.get(request.request_id) if logprobs_by_id else None
            update.outputs[index].kv_transfer_params = self._forget_finished(request, rows)
        return update.outputs

    def _output(
        self, request: Request, num_outputs_before: int, logprobs_by_id: dict
    ) -> EngineCoreOutput:
        """A request's output of its tokens from `num_outputs_before` on, made outside a
        step's recording (a first token that came with the request, prompt logprobs)."""
        rows = logprobs_by_id.get(request.request_id)
        output = core_output(request, num_outputs_before, None, rows)
        if request.is_finished:
            output.kv_transfer_params = self._forget_finished(request, rows)
        return output

    def _forget_finished(
        self, request: Request, rows: list[dict[int, Logprob]] | None
    ) -> dict[str, Any] | None:
        """A finished request's per-request state goes; on a prefill instance its prompt KV
        is held for the decode side (the output's kv_transfer_params)."""
        request_id = request.request_id
        generator = self._forget_sampling(request_id)
        if request.hold_kv and request_id in self.scheduler.detached:
            return self._hold_kv(request, rows, generator)
        return None

    def _forget_sampling(self, request_id: str) -> torch.Generator | None:
        """Drop what the engine core keeps to sample a request (finished or aborted); its
        seeded generator, if it had one."""
        self._sync_request_ids.discard(request_id)
        self._min_tokens_ids.discard(request_id)
        self._not_argmax_ids.discard(request_id)
        self._not_plain_ids.discard(request_id)
        self.structured.forget(request_id)
        return self.generators.pop(request_id, None)

    def _hold_kv(
        self,
        request: Request,
        rows: list[dict[int, Logprob]] | None,
        generator: torch.Generator | None,
    ) -> dict[str, Any]:
        """Prefill side: hand a finished request's prompt blocks to the sender to keep."""
        connector = self.kv_connector
        assert connector is not None
        request_id = request.request_id
        blocks = self.scheduler.detached[request_id]
        num_prompt_blocks = self.kv_cache_manager.blocks_needed(request.num_prompt_tokens)
        block_ids = [block.block_id for block in blocks[:num_prompt_blocks]]
        streamed = request_id in connector.streaming
        params = connector.hold(request, block_ids, rows[0] if rows else None, generator)
        if streamed:  # copied out: the blocks go back now
            self.scheduler.release_detached(request_id)
        return params

    def _stage_streams(self, entries: list[ScheduledRequest]) -> None:
        """Prefill side: copy out the blocks this step completed of prompts that stream
        (the finished ones' last blocks when they finish; a preempted one's blocks are gone,
        and its copying goes on once its recomputation passes the blocks already copied)."""
        connector = self.kv_connector
        running = RequestStatus.RUNNING
        for entry in entries:
            request_id = entry.request_id
            if request_id not in connector.streaming:
                continue
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.status is running:
                block_ids = self.kv_cache_manager.get_block_ids(request_id)
                computed = entry.num_computed_tokens + entry.num_new_tokens
                connector.stage(request, block_ids, computed)

    def scheduler_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        stats = SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_requests_received=self.num_requests_received,
            spec_num_drafts=self.spec_decode_stats.num_drafts,
            spec_num_draft_tokens=self.spec_decode_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_decode_stats.num_accepted_tokens,
            spec_accepted_per_position=list(self.spec_decode_stats.accepted_per_position),
        )
        connector = self.kv_connector
        if connector is not None and connector.sender is not None:
            sent = connector.sender.stats
            stats.kv_num_sent, stats.kv_sent_blocks = sent.num_sent, sent.num_sent_blocks
            stats.kv_sent_bytes, stats.kv_num_expired = sent.sent_bytes, sent.num_expired
            stats.kv_held_blocks = connector.sender.num_held_blocks
        if connector is not None and connector.receiver is not None:
            loaded = connector.load_stats
            stats.kv_num_loaded, stats.kv_num_load_failed = loaded.num_loaded, loaded.num_failed
            stats.kv_loaded_blocks, stats.kv_loaded_bytes = loaded.num_blocks, loaded.num_bytes
            stats.kv_load_seconds, stats.kv_cached_blocks = loaded.seconds, loaded.num_cached_blocks
        return stats

    @property
    def step_stats(self) -> deque[StepStats]:
        """Every step's telemetry, oldest first (the last max_step_stats steps). Reading it
        works out the steps still waiting (finish_stats): from the step loop's thread only."""
        self.finish_stats()
        return self._step_stats

    def take_finished_stats(self) -> list[StepStats]:
        """The telemetry worked out since the last call, oldest first: what the step loop's
        stat loggers take as it comes (every step's by the time the engine idles)."""
        stats = self._step_stats
        count = min(self._num_stats_finished - self._num_stats_taken, len(stats))
        self._num_stats_taken = self._num_stats_finished
        return [stats[index] for index in range(-count, 0)]

    def _record_stats(
        self,
        scheduled: SchedulerOutput,
        step_time: float,
        num_accepted_tokens: int,
        propose_time: float,
        num_steps: int = 1,
        catch_up_time: float = 0.0,
    ) -> None:
        """`propose_time`: of the step, the proposer's guessing for the next step (a draft
        model's forwards), of which `catch_up_time` went on backlogs, paid once (a new
        request's prompt): the next step's choice of drafts and the measured check weigh the
        rest. The step-cost model learns the step without any of it: the scheduled batch's cost
        (per forward, for the `num_steps` forwards of multi-step scheduling).
        Each step's roofline and the cost model's learning are worked out TELEMETRY_BATCH
        steps at a time, when the engine goes idle, or when step_stats is read: right after a
        forward every line of Python runs at a third of its speed, its code and data pushed
        out of the caches by the weights; a batch of steps runs at the full speed. A scheduler
        that forecasts steps gets each step's learning before it plans the next (with async
        scheduling, as before, the one after; with adaptive speculation and no ITL target,
        before each step whose drafts it may weigh). With async scheduling a batch is worked out
        while the next step's forward runs: where the host, not the forward, sets the pace,
        every 16th step's time includes it (the total is less than step by step)."""
        self.num_steps += 1
        if self.forward_threads is not None:
            self._fit_threads(step_time)
        self.num_preemptions += len(scheduled.preempted_request_ids)
        self.num_prefill_tokens += scheduled.num_prefill_tokens
        num_decode_tokens = scheduled.num_decode_tokens * num_steps
        self.num_decode_tokens += num_decode_tokens
        if scheduled.num_prefill_tokens == 0 and self.proposer is not None:
            # The time this step's tokens cost: its own work, and the guessing for its drafts
            # (done in the previous step); not the guessing for the next step.
            seconds = step_time - propose_time
            if scheduled.num_draft_tokens:
                seconds += self.scheduler.proposal_seconds
            num_sampled = sum(1 for entry in scheduled.scheduled if entry.sample)
            self.scheduler.speculation_guard.observe(
                len(scheduled.scheduled), scheduled.num_draft_tokens > 0,
                num_sampled * num_steps + num_accepted_tokens, seconds,
                all_greedy(scheduled.requests),
            )  # fmt: skip
        self.scheduler.proposal_seconds = propose_time - catch_up_time
        scheduler = self.scheduler
        stats = StepStats(
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            num_seqs=len(scheduled.scheduled),
            num_preempted=len(scheduled.preempted_request_ids),
            step_time=step_time,
            kv_usage=self.kv_cache_manager.usage,
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            num_draft_tokens=scheduled.num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            propose_time=propose_time,
            num_steps=num_steps,
        )
        wall_time = 0.0 if self.step_log is None else time.time()
        self._unfinished_stats.append((stats, scheduled.sums, propose_time, wall_time))
        if (
            self._telemetry_each_step
            or len(self._unfinished_stats) >= TELEMETRY_BATCH
            or not scheduler.has_schedulable_requests()
            or (
                self._telemetry_before_drafts
                and any(request.spec_token_ids for request in scheduler.running)
            )
        ):
            self.finish_stats()

    def _fit_threads(self, step_time: float) -> None:
        """Use fewer forward threads while another process holds some of the cores
        (worker/cpu_threads.py): here, and on the executor's thread where the forwards run
        there (OpenMP keeps the count per thread)."""
        assert self.forward_threads is not None
        threads = self.forward_threads.observe(step_time)
        if threads is None:
            return
        torch.set_num_threads(threads)
        if self._executor is not None:  # after the step launched already
            self._executor.submit(torch.set_num_threads, threads)

    @contextlib.contextmanager
    def forward_thread_count(self) -> Iterator[None]:
        """The offline loop's steps run on the caller's thread: they take the count fitted so
        far, and the caller gets its own back after."""
        if self.forward_threads is None:
            yield
            return
        callers = torch.get_num_threads()
        torch.set_num_threads(self.forward_threads.threads)
        try:
            yield
        finally:
            torch.set_num_threads(callers)

    def finish_stats(self) -> None:
        """Work out each recorded step's roofline and the cost model's forecast of it, in step
        order (the model learns from every step after forecasting it). Should one fail, the
        steps after it in the batch are dropped: telemetry, not the engine's state."""
        if not self._unfinished_stats:
            return
        unfinished, self._unfinished_stats = self._unfinished_stats, []
        shape, peaks, cost_model = self.model_shape, self.peaks, self.cost_model
        first_step = self.num_steps - len(unfinished) + 1
        for step, (stats, sums, propose_time, wall_time) in enumerate(unfinished, first_step):
            work, num_steps = sums_work(shape, sums), stats.num_steps
            # Multi-step forwards: each as the first (their contexts a few positions longer).
            total = work if num_steps == 1 else StepWork(work.flops * num_steps,
                                                         work.bytes * num_steps)  # fmt: skip
            roofline = place_step(total, stats.step_time, peaks)
            stats.flops, stats.bytes = roofline.flops, roofline.bytes
            stats.mfu, stats.mbu, stats.bound = roofline.mfu, roofline.mbu, roofline.bound
            stats.predicted_step_time = cost_model.observe(
                sums, stats.step_time - propose_time, work, num_steps
            )
            stats.num_attended = sums.num_attended
            stats.num_context = sums.num_context
            stats.num_sampled = sums.num_sampled
            self._step_stats.append(stats)
            self._num_stats_finished += 1
            if self.step_log is not None:
                record = {
                    "step": step,
                    "time": wall_time,
                    "phase": stats.phase,
                    **dataclasses.asdict(stats),
                }
                self.step_log.write(json.dumps(record) + "\n")
