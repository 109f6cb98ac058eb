"""The engine core: token ids in, token ids out. One step = schedule → forward → sample →
update. It owns the scheduler, the KV cache manager, the model runner and the sampler; text,
stop strings and n > 1 live in the front end (llm_engine.py)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.scheduler import Scheduler, SchedulerOutput
from tandem.engine.stats import SchedulerStats, StepStats
from tandem.outputs import Logprob
from tandem.request import Request, RequestStatus
from tandem.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig
from tandem.worker.sampler import SamplingInputs, sample

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one request got from a step (only requests that sampled or finished appear)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: list[float] = field(default_factory=list)  # of the new tokens
    finished_time: float | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, max_step_stats: int = 100_000) -> None:
        runner_config, scheduler_config = config.runner, config.scheduler
        self.runner = ModelRunner(runner_config)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_kv_blocks,
            runner_config.block_size,
            config.enable_prefix_caching,
            config.prefix_caching_hash_algo,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.generators: dict[str, torch.Generator] = {}
        self.step_stats: deque[StepStats] = deque(maxlen=max_step_stats)
        self.num_steps = 0
        self.num_preemptions = 0
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

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        seed = request.sampling_params.seed
        if seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(seed)
            self.generators[request.request_id] = generator

    def finish_requests(
        self, request_ids: list[str], status: RequestStatus, stop_reason: str | None = None
    ) -> None:
        """End requests from outside: aborts, or stop strings found in the detokenized text."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and stop_reason is not None:
                request.stop_reason = stop_reason
            self.generators.pop(request_id, None)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        sampled_requests = [
            self.scheduler.requests[s.request_id] for s in scheduled.scheduled if s.sample
        ]
        logits = self.runner.execute(scheduled.scheduled, [s.sample for s in scheduled.scheduled])
        sampler_output = sample(logits, self._sampling_inputs(sampled_requests))
        token_ids = sampler_output.token_ids.tolist()
        sampled = {r.request_id: [t] for r, t in zip(sampled_requests, token_ids, strict=True)}
        num_outputs_before = {r.request_id: r.num_output_tokens for r in sampled_requests}
        updated = self.scheduler.update_from_output(scheduled, sampled)
        logprobs_by_id = {}
        if sampler_output.logprobs is not None:
            logprobs_by_id = {
                r.request_id: row
                for r, row in zip(sampled_requests, sampler_output.logprobs, strict=True)
                if row is not None
            }
        outputs = [
            self._output(r, num_outputs_before[r.request_id], logprobs_by_id) for r in updated
        ]
        self._record_stats(scheduled, time.perf_counter() - start)
        return outputs

    def _sampling_inputs(self, requests: list[Request]) -> SamplingInputs:
        blocked = []
        for request in requests:
            params = request.sampling_params
            if request.num_output_tokens < params.min_tokens:
                eos = [] if request.eos_token_id is None else [request.eos_token_id]
                blocked.append(eos + params.stop_token_ids)
            else:
                blocked.append([])
        return SamplingInputs(
            params=[r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            generators=[self.generators.get(r.request_id) for r in requests],
            stop_token_ids_to_block=blocked,
        )

    def _output(
        self, request: Request, num_outputs_before: int, logprobs_by_id: dict
    ) -> EngineCoreOutput:
        if request.is_finished:
            self.generators.pop(request.request_id, None)
        row = logprobs_by_id.get(request.request_id)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=request.output_token_ids[num_outputs_before:],
            new_logprobs=None if row is None else [row],
            finish_reason=None if not request.is_finished else str(request.status.finish_reason),
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            token_times=request.token_times[num_outputs_before:],
            finished_time=request.finished_time,
        )

    def scheduler_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
        )

    def _record_stats(self, scheduled: SchedulerOutput, step_time: float) -> None:
        self.num_steps += 1
        self.num_preemptions += len(scheduled.preempted_request_ids)
        self.step_stats.append(
            StepStats(
                num_prefill_tokens=scheduled.num_prefill_tokens,
                num_decode_tokens=scheduled.num_decode_tokens,
                num_seqs=len(scheduled.scheduled),
                num_preempted=len(scheduled.preempted_request_ids),
                step_time=step_time,
                kv_usage=self.kv_cache_manager.usage,
                num_waiting=self.scheduler.num_waiting,
                num_running=self.scheduler.num_running,
            )
        )
