"""The engine front end: prompts in, RequestOutputs out. It fans n > 1 out into sequences,
detokenizes incrementally, finds stop strings, and assembles vLLM-shaped outputs over the core."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.engine_core import EngineCore, EngineCoreOutput
from tandem.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # every update carries the whole text so far
    DELTA = "delta"  # every update carries only what is new (streaming)
    FINAL_ONLY = "final"  # one output, when the request finishes


@dataclass
class _Sequence:
    """One of a request's n completions."""

    index: int
    request_id: str  # the core's id for this sequence
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: OutputKind
    sequences: list[_Sequence]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


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
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = extra_eos_token_ids
        self.requests: dict[str, _RequestState] = {}
        self._sequence_owner: dict[str, tuple[_RequestState, _Sequence]] = {}

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
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; give stop_token_ids instead")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, output_kind, [])
        core_requests = []
        for index in range(params.n):
            sequence_id = request_id if params.n == 1 else f"{index}_{request_id}"
            core_requests.append(
                Request(
                    sequence_id,
                    state.prompt_token_ids,
                    self._sequence_params(params, index),
                    self.eos_token_id,
                    arrival_time,
                    cache_salt,
                )
            )
            state.sequences.append(
                _Sequence(
                    index=index,
                    request_id=sequence_id,
                    detokenizer=self._detokenizer(state.prompt_token_ids, params),
                    metrics=RequestMetrics(arrival_time=arrival_time),
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        added = []
        try:
            for request in core_requests:
                self.core.add_request(request)
                added.append(request.request_id)
        except ValueError:
            self.core.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.requests[request_id] = state
        for sequence in state.sequences:
            self._sequence_owner[sequence.request_id] = (state, sequence)

    def _sequence_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Per-sequence copy: extra EOS ids become stop tokens; seeds differ across n."""
        changes: dict = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        return dataclasses.replace(params, **changes)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        ids = [s.request_id for s in state.sequences]
        self.core.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for sequence_id in ids:
            self._sequence_owner.pop(sequence_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for each request that has news (by its kind)."""
        touched: dict[str, _RequestState] = {}
        for core_output in self.core.step():
            owner = self._sequence_owner.get(core_output.request_id)
            if owner is None:
                continue
            state, sequence = owner
            self._apply(sequence, core_output)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                del self.requests[state.request_id]
                for sequence in state.sequences:
                    self._sequence_owner.pop(sequence.request_id, None)
            if state.output_kind is not OutputKind.FINAL_ONLY or state.finished:
                outputs.append(self._request_output(state))
        return outputs

    def _apply(self, sequence: _Sequence, out: EngineCoreOutput) -> None:
        sequence.token_ids.extend(out.new_token_ids)
        metrics = sequence.metrics
        metrics.first_scheduled_time = out.first_scheduled_time
        metrics.first_token_time = out.first_token_time
        metrics.token_times.extend(out.token_times)
        metrics.num_cached_tokens = out.num_cached_tokens
        metrics.num_preemptions = out.num_preemptions
        if out.new_logprobs is not None and sequence.logprobs is not None:
            for token_id, row in zip(out.new_token_ids, out.new_logprobs, strict=False):
                if self.tokenizer is not None:
                    for candidate, logprob in row.items():
                        logprob.decoded_token = self.tokenizer.decode([candidate])
                sequence.logprobs.append(row)
                sequence.cumulative_logprob += row[token_id].logprob
        sequence.finish_reason, sequence.stop_reason = out.finish_reason, out.stop_reason
        if sequence.detokenizer is not None and out.new_token_ids:
            stop_string = sequence.detokenizer.update(out.new_token_ids)
            if stop_string is not None and out.finish_reason is None:
                self.core.finish_requests(
                    [sequence.request_id], RequestStatus.FINISHED_STOPPED, stop_string
                )
                sequence.finish_reason, sequence.stop_reason = "stop", stop_string
        if sequence.finish_reason is not None:
            metrics.finished_time = out.finished_time or time.monotonic()

    def _request_output(self, state: _RequestState) -> RequestOutput:
        delta = state.output_kind is OutputKind.DELTA
        completions = []
        for sequence in state.sequences:
            finished = sequence.finish_reason is not None
            start = sequence.num_sent_tokens if delta else 0
            text = ""
            if sequence.detokenizer is not None:
                text = sequence.detokenizer.get_next_output_text(finished, delta)
            completions.append(
                CompletionOutput(
                    index=sequence.index,
                    text=text,
                    token_ids=sequence.token_ids[start:],
                    cumulative_logprob=sequence.cumulative_logprob,
                    logprobs=None if sequence.logprobs is None else sequence.logprobs[start:],
                    finish_reason=sequence.finish_reason,
                    stop_reason=sequence.stop_reason,
                    metrics=sequence.metrics,
                )
            )
            sequence.num_sent_tokens = len(sequence.token_ids)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.finished,
            metrics=state.sequences[0].metrics,
        )
