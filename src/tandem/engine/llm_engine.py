"""The in-process engine: an `OutputProcessor` over an `EngineCore` in the same process, stepped
by the caller (the offline `LLM`, `tandem chat`). The server runs the same two pieces split
across processes (async_llm.py, core_process.py)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from tandem.engine.engine_core import EngineCore
from tandem.engine.output_processor import OutputKind, OutputProcessor
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
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, eos_token_id, extra_eos_token_ids)

    @property
    def max_model_len(self) -> int:
        return self.core.scheduler.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) for one that cannot run."""
        core_requests = self.processor.add_request(
            request_id, prompt_token_ids, params, prompt, output_kind, arrival_time, cache_salt
        )
        added = []
        try:
            for request in core_requests:
                self.core.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            self.processor.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> None:
        aborted = self.processor.abort_request(request_id)
        self.core.finish_requests([a.request_id for a in aborted], RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for each request that has news (by its kind)."""
        processed = self.processor.process_outputs(self.core.step())
        for sequence_id, stop_string in processed.stopped:
            self.core.finish_requests([sequence_id], RequestStatus.FINISHED_STOPPED, stop_string)
        return processed.request_outputs
