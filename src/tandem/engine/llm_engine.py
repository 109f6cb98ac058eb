"""The in-process engine: an `OutputProcessor` over an `EngineCore` in the same process, stepped
by the caller (the offline `LLM`, `tandem chat`). The server runs the same two pieces split
across processes (async_llm.py, core_process.py). `LLM.llm_engine` is this object."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from transformers import PreTrainedTokenizerBase

from tandem.engine.engine_core import EngineCore
from tandem.engine.output_processor import OutputKind, OutputProcessor
from tandem.engine.stats import StatLogger
from tandem.outputs import RequestOutput
from tandem.request import RequestStatus
from tandem.sampling_params import SamplingParams

__all__ = ["LLMEngine", "OutputKind"]


class LLMEngine:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_id: int | None,
        extra_eos_token_ids: tuple[int, ...] = (),
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, eos_token_id, extra_eos_token_ids)
        self.stat_loggers = list(stat_loggers)

    @property
    def max_model_len(self) -> int:
        return self.core.scheduler.max_model_len

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) for one that cannot run.
        `priority` orders it under scheduling_policy="priority" (lower first), as in vLLM."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        params = self.core.config.request_params(params)
        core_requests = self.processor.add_request(
            request_id, prompt_token_ids, params, prompt, output_kind, arrival_time, cache_salt
        )
        added = []
        try:
            for request in core_requests:
                request.priority = priority
                self.core.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            self.processor.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            aborted = self.processor.abort_request(request_id)
            ids = [a.request_id for a in aborted]
            self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for record in aborted:
                for stat_logger in self.stat_loggers:
                    stat_logger.record_finished(record)
        if self.stat_loggers:  # an engine left idle has worked out its last steps' telemetry
            steps = self.core.take_finished_stats()
            scheduler_stats = self.core.scheduler_stats()
            for stat_logger in self.stat_loggers:
                stat_logger.record_steps(scheduler_stats, steps)

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for each request that has news (by its kind)."""
        processed = self.processor.process_outputs(self.core.step())
        for sequence_id, stop_string in processed.stopped:
            self.core.finish_requests([sequence_id], RequestStatus.FINISHED_STOPPED, stop_string)
        if not self.processor.has_unfinished_requests() and self.core.has_unfinished_requests():
            self.core.step()  # land a step still in flight for requests already ended
        if self.stat_loggers:
            steps = self.core.take_finished_stats()
            scheduler_stats = self.core.scheduler_stats()
            for stat_logger in self.stat_loggers:
                stat_logger.record_steps(scheduler_stats, steps)
                for record in processed.finished:
                    stat_logger.record_finished(record)
        return processed.request_outputs
