"""What the API process and the engine-core process say to each other over ZeroMQ, as msgspec
structs encoded with msgpack: typed, compact, and decoded without pickle. One `CoreOutputs`
message carries everything one step produced, so IPC cost is per step, not per token."""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.core.outputs import EngineCoreOutput
from tandem.engine.stats import SchedulerStats, StepStats
from tandem.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.monotonic(): one clock for every process on the machine
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower first under scheduling_policy="priority"
    kv_transfer_params: dict[str, Any] | None = None  # disaggregation (kv_transfer/params.py)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility"):
    """Call one of the core's whitelisted methods (core_process.UTILITY_METHODS)."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class OutputsWritten(msgspec.Struct, tag="written"):
    """The streams that the CoreOutputs numbered `ack` woke have written their chunks."""

    ack: int


CoreInput = AddRequest | AbortRequests | UtilityCall | Shutdown | OutputsWritten


class CoreReady(msgspec.Struct, tag="ready"):
    num_kv_blocks: int
    block_size: int
    max_model_len: int  # what the scheduler enforces: the config's, capped by the KV cache
    load_seconds: float


class RequestError(msgspec.Struct):
    """A request the core refused; the others go on."""

    request_id: str
    message: str


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    errors: list[RequestError]
    scheduler_stats: SchedulerStats
    steps: list[StepStats]
    # Nonzero: the core waits for OutputsWritten(ack) before its next step (stream writes
    # first: core_process.py).
    written_ack: int = 0


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start, or its step loop raised: it exits after sending this."""

    message: str


CoreMessage = CoreReady | CoreOutputs | UtilityResult | CoreFailed
