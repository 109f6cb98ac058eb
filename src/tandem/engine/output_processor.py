"""Turns the engine core's token ids into what users get: it fans n > 1 out into sequences,
detokenizes incrementally, finds stop strings and assembles vLLM-shaped RequestOutputs. It never
calls the core: it says which sequences a stop string ended, so the same object serves the
in-process `LLMEngine` and the API process of the server, where the core is another process."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.stats import FinishedRequestStats
from tandem.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tandem.request import Request
from tandem.sampling_params import RequestOutputKind, SamplingParams, tokenize_bad_words

# The engine's older name for the one enum SamplingParams.output_kind holds.
OutputKind = RequestOutputKind


@dataclass(slots=True)
class _Sequence:
    """One of a request's n completions."""

    index: int
    request_id: str  # the core's id for this sequence
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    sequences: list[_Sequence]
    # With params.prompt_logprobs: [None] then the first sequence's rows as they arrive (only
    # that sequence computes them; the n sequences share one prompt).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once
    kv_transfer_params: dict | None = None  # a prefill instance's answer, once finished

    @property
    def finished(self) -> bool:
        sequences = self.sequences
        if len(sequences) == 1:  # n = 1, nearly always: no generator per call
            return sequences[0].finish_reason is not None
        return all(s.finish_reason is not None for s in sequences)

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """What an output carries: the whole list once complete, in DELTA mode only once."""
        logprobs = self.prompt_logprobs
        if logprobs is None or len(logprobs) < len(self.prompt_token_ids):
            return None
        if self.output_kind is RequestOutputKind.DELTA:
            if self.prompt_logprobs_sent:
                return None
            self.prompt_logprobs_sent = True
        return logprobs


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Sequences a stop string ended (core id, stop string): the core must finish them too.
    stopped: list[tuple[str, str]]
    finished: list[FinishedRequestStats]


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_token_id: int | None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.extra_eos_token_ids = extra_eos_token_ids
        self.requests: dict[str, _RequestState] = {}
        self._sequence_owner: dict[str, tuple[_RequestState, _Sequence]] = {}
        self._token_texts: dict[int, str] = {}  # each token's text, for logprobs, once decoded

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        output_kind: RequestOutputKind | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """Track a request; returns the core requests (one per sequence) to submit.
        `output_kind` overrides params.output_kind (the offline LLM wants final outputs)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; give stop_token_ids instead")
        bad_words = None
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer to become token ids")
            bad_words = params.bad_words_token_ids or tokenize_bad_words(
                params.bad_words, self.tokenizer
            )
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        kind = params.output_kind if output_kind is None else output_kind
        state = _RequestState(request_id, prompt, list(prompt_token_ids), params, kind, [])
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        core_requests = []
        for index in range(params.n):
            sequence_id = request_id if params.n == 1 else f"{index}_{request_id}"
            core_requests.append(
                Request(
                    sequence_id,
                    state.prompt_token_ids,
                    self._sequence_params(params, index, bad_words),
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
        self.requests[request_id] = state
        for sequence in state.sequences:
            self._sequence_owner[sequence.request_id] = (state, sequence)
        return core_requests

    def abort_request(self, request_id: str) -> list[FinishedRequestStats]:
        """Forget a request; returns a record for each of its sequences that had not finished
        (their core ids are the ones to abort in the core)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        aborted = []
        for sequence in state.sequences:
            self._sequence_owner.pop(sequence.request_id, None)
            if sequence.finish_reason is None:
                sequence.finish_reason = "abort"
                sequence.metrics.finished_time = time.monotonic()
                aborted.append(self._finished_stats(state, sequence))
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's core outputs; an output for each request with news (by its kind)."""
        touched: dict[str, _RequestState] = {}
        stopped: list[tuple[str, str]] = []
        finished: list[FinishedRequestStats] = []
        for core_output in core_outputs:
            owner = self._sequence_owner.get(core_output.request_id)
            if owner is None or owner[1].finish_reason is not None:
                continue  # aborted, or a stop string ended it before the core heard of it
            state, sequence = owner
            if core_output.new_prompt_logprobs and state.prompt_logprobs is not None:
                if state.params.detokenize:
                    self._decode_logprob_tokens(core_output.new_prompt_logprobs)
                state.prompt_logprobs.extend(core_output.new_prompt_logprobs)
            if core_output.kv_transfer_params is not None:
                state.kv_transfer_params = core_output.kv_transfer_params
            stop_string = self._apply(sequence, core_output)
            if stop_string is not None:
                stopped.append((sequence.request_id, stop_string))
            if sequence.finish_reason is not None:
                finished.append(self._finished_stats(state, sequence))
            if core_output.new_token_ids or sequence.finish_reason is not None:
                touched[state.request_id] = state  # not for a prompt chunk's logprobs alone
        outputs = []
        for state in touched.values():
            done = state.finished
            if done:
                del self.requests[state.request_id]
                for sequence in state.sequences:
                    self._sequence_owner.pop(sequence.request_id, None)
            if done or state.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._request_output(state))
        return ProcessedOutputs(outputs, stopped, finished)

    @staticmethod
    def _finished_stats(state: _RequestState, sequence: _Sequence) -> FinishedRequestStats:
        return FinishedRequestStats(
            request_id=sequence.request_id,
            finish_reason=sequence.finish_reason,
            num_prompt_tokens=len(state.prompt_token_ids),
            num_generation_tokens=len(sequence.token_ids),
            metrics=sequence.metrics,
        )

    def _sequence_params(
        self, params: SamplingParams, index: int, bad_words: list[list[int]] | None
    ) -> SamplingParams:
        """Per-sequence copy: extra EOS ids become stop tokens; seeds differ across n; only the
        first sequence computes the prompt logprobs they share (the others may take prefix-cache
        hits); bad_words travel as token ids."""
        changes: dict = {"n": 1, "best_of": None, "_bad_words_token_ids": bad_words}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if index > 0:
            changes["prompt_logprobs"] = None
        if self.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
            changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        return dataclasses.replace(params, **changes)

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams):
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            min_tokens=params.min_tokens,
        )

    def _apply(self, sequence: _Sequence, out: EngineCoreOutput) -> str | None:
        """Record a core output; returns the stop string it completed, if any. Of several new
        tokens (accepted drafts), those after the one that completes a stop string are
        dropped, as if they had never been sampled."""
        new_token_ids = out.new_token_ids
        stop_string = None
        if sequence.detokenizer is not None and new_token_ids:
            # An EOS or stop token that ended the request leaves its text out (vLLM).
            stop_terminated = out.finish_reason == "stop"
            num_kept, stop_string = sequence.detokenizer.update_until_stop(
                new_token_ids, stop_terminated
            )
            new_token_ids = new_token_ids[:num_kept]
        sequence.token_ids.extend(new_token_ids)
        metrics = sequence.metrics
        metrics.first_scheduled_time = out.first_scheduled_time
        metrics.first_token_time = out.first_token_time
        metrics.token_times.extend([out.token_time] * len(new_token_ids))
        metrics.num_cached_tokens = out.num_cached_tokens
        metrics.num_preemptions = out.num_preemptions
        metrics.num_draft_tokens = out.num_draft_tokens
        metrics.num_accepted_tokens = out.num_accepted_tokens
        if out.new_logprobs is not None and sequence.logprobs is not None:
            new_logprobs = out.new_logprobs[: len(new_token_ids)]
            if sequence.detokenizer is not None:
                self._decode_logprob_tokens(new_logprobs)
            for token_id, row in zip(new_token_ids, new_logprobs, strict=False):
                sequence.logprobs.append(row)
                sequence.cumulative_logprob += row[token_id].logprob
        sequence.finish_reason, sequence.stop_reason = out.finish_reason, out.stop_reason
        if stop_string is not None:
            # It wins over the core's reason, as in vLLM; the core must hear of it only if it
            # has not finished the sequence itself.
            sequence.finish_reason, sequence.stop_reason = "stop", stop_string
            if out.finish_reason is not None:
                stop_string = None
        if sequence.finish_reason is not None:
            metrics.finished_time = out.finished_time or time.monotonic()
        return stop_string

    def _decode_logprob_tokens(self, rows: list[dict[int, Logprob]]) -> None:
        """Fill each candidate's decoded_token (when there is a tokenizer), decoding each id
        once for the processor's life: long prompts and logprobs=-1 repeat many ids."""
        if self.tokenizer is None:
            return
        texts = self._token_texts
        new = list({candidate for row in rows for candidate in row if candidate not in texts})
        if new:
            texts.update(zip(new, self.tokenizer.batch_decode([[i] for i in new]), strict=True))
        for row in rows:
            for candidate, logprob in row.items():
                logprob.decoded_token = texts[candidate]

    def _request_output(self, state: _RequestState) -> RequestOutput:
        delta = state.output_kind is RequestOutputKind.DELTA
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
            prompt_logprobs=state.take_prompt_logprobs(),
            kv_transfer_params=state.kv_transfer_params,
        )
