"""What a step gives each request, as the engine core sends it to the front end (the output
processor, in this process or the API server's). The scheduler builds them as it records a
step's tokens: that loop already reads every field they carry, and a second pass over the
requests to build them cost as much again (~0.15 us a running request a step). No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.outputs import Logprob
from tandem.records import record
from tandem.request import Request


@record(array_like=True)
class EngineCoreOutput:
    """What one request got from a step. Requests that sampled or finished appear, and prompt
    chunks that scored prompt logprobs (with no new tokens)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None
    first_token_time: float | None
    token_time: float | None  # when the new tokens were sampled (one step samples them all)
    finished_time: float | None = None
    # Prompt logprobs this step computed, one per prompt position in order from the second
    # prompt token (the first has none); each position is sent once, even after a preemption.
    new_prompt_logprobs: list[dict[int, Logprob]] | None = None
    # Speculative decoding so far: draft tokens verified for the request, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Disaggregation, prefill side: where the finished request's prompt KV waits (the
    # response's kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None


def core_output(
    request: Request, start: int, end: int | None, rows: list[dict[int, Logprob]] | None
) -> EngineCoreOutput:
    """The request's output of its output tokens [start, end), with their logprob rows where
    it asked for them (`rows`, from the first of those tokens on). The scheduler's recording
    loop builds the common case, one token of a running request, in line."""
    status = request.status
    new_token_ids = request.output_token_ids[start:end]
    return EngineCoreOutput(
        request.request_id,
        new_token_ids,
        None if rows is None else rows[: len(new_token_ids)],
        status.finish_reason.value if status.is_finished else None,  # type: ignore[union-attr]
        request.stop_reason,
        request.num_cached_tokens,
        request.num_preemptions,
        request.first_scheduled_time,
        request.first_token_time,
        request.last_token_time,
        request.finished_time,
        None,
        request.num_draft_tokens,
        request.num_accepted_tokens,
    )


@dataclass
class StepUpdate:
    """What recording a step's tokens gave: an output for each request that got tokens, in the
    step's order, the request of each, and the positions of those that finished (the engine
    core forgets their state, and on a prefill instance holds their KV)."""

    outputs: list[EngineCoreOutput]
    requests: list[Request]
    finished: list[int]
