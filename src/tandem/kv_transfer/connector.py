"""The engine core's handle on disaggregation: what a request's kv_transfer_params ask of this
instance, what a prefill instance answers, and the loads a decode instance starts and lands.
The core calls it from its own thread only; the transfers run on the sender's and receiver's
threads and wake the core (`set_wake`) when they have news. A streamed prefill request's blocks
are copied out here, on the core's thread, right after the step that computed them: a copy
taken there cannot race with a later step reusing the blocks."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kv_transfer.channel import blocks_per_chunk, chunk_ranges, gather_blocks
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.params import (
    KVLoad,
    Remote,
    RemotePrefill,
    RemoteStream,
    check_kv_transfer,
    prompt_digest,
    transfer_id_of,
    wants_remote_decode,
)
from tandem.kv_transfer.receiver import KVReceiver, LoadResult
from tandem.kv_transfer.sender import KVSender, StagedStream
from tandem.outputs import Logprob
from tandem.request import Request


@dataclass
class KVLoadStats:
    """A decode instance's pulls, cumulative."""

    num_loaded: int = 0
    num_failed: int = 0  # fell back to a local prefill
    num_blocks: int = 0  # pulled
    num_cached_blocks: int = 0  # local prefix-cache hits, not pulled again
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Streaming:
    """A prefill request whose blocks stream: its stream and the blocks copied out so far."""

    stream: StagedStream
    num_staged_blocks: int = 0


class KVConnector:
    def __init__(self, config: KVTransferConfig, kv_caches: Sequence[torch.Tensor]) -> None:
        self.config = config
        self.role = config.role
        self.engine_id = uuid.uuid4().hex
        self.block_size = kv_caches[0].shape[2]
        self._wake: Callable[[], None] = lambda: None
        notify = self._notify
        self.sender = KVSender(config, kv_caches, notify) if self.role == "prefill" else None
        self.receiver = KVReceiver(config, kv_caches, notify) if self.role == "decode" else None
        self.load_stats = KVLoadStats()
        self.kv_caches = list(kv_caches)
        # A streamed step's blocks are copied out in pieces of about chunk_bytes: on a GPU the
        # copy goes through a device buffer, which must stay small next to the KV cache.
        self.blocks_per_chunk = blocks_per_chunk(self.kv_caches, config.chunk_bytes)
        self.streaming: dict[str, _Streaming] = {}  # prefill side, by request id

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` is called from transfer threads when take_* has news for the core."""
        self._wake = wake

    def _notify(self) -> None:
        self._wake()

    def accept(self, request: Request, params: dict[str, Any], vocab_size: int) -> Remote | None:
        """Read a request's kv_transfer_params (params.check_kv_transfer). Prefill side: the
        request keeps its prompt's blocks when it finishes, or streams them with a transfer
        id. Decode side: the place its prompt's KV waits, and its first token if known
        (returned)."""
        remote = check_kv_transfer(
            params, self.role, request.prompt_token_ids, request.sampling_params,
            self.block_size, vocab_size,
        )  # fmt: skip
        if wants_remote_decode(params):
            transfer_id = transfer_id_of(params)
            if transfer_id is not None:
                assert self.sender is not None
                if request.request_id in self.streaming:
                    raise ValueError(f"request id {request.request_id!r} is already in use")
                digest = prompt_digest(request.prompt_token_ids)
                stream = self.sender.open_stream(transfer_id, request.num_prompt_tokens, digest)
                self.streaming[request.request_id] = _Streaming(stream)
            request.hold_kv = True
        return remote

    # -- prefill side -----------------------------------------------------------------------

    def stage(self, request: Request, block_ids: list[int], num_computed_tokens: int) -> None:
        """Copy out the prompt blocks of a streaming request that the step just ended has
        completed (`num_computed_tokens`: its tokens computed by then)."""
        streaming = self.streaming[request.request_id]
        if streaming.stream.failed or streaming.stream.gone:
            return  # its decode side has given up: no copy (they only ever turn true)
        num_tokens = min(num_computed_tokens, request.num_prompt_tokens)
        num_full = num_tokens // self.block_size
        if num_tokens == request.num_prompt_tokens:
            num_full = -(-num_tokens // self.block_size)  # the last, partly filled block too
        first = streaming.num_staged_blocks
        if num_full <= first:
            return
        assert self.sender is not None
        ids = torch.tensor(block_ids[first:num_full], dtype=torch.int64)
        for start, stop in chunk_ranges(num_full - first, self.blocks_per_chunk):
            chunk = gather_blocks(self.kv_caches, ids[start:stop])
            self.sender.stage(streaming.stream, first + start, chunk)
        streaming.num_staged_blocks = num_full

    def drop_stream(self, request_id: str) -> None:
        """A streaming prefill request ended without its first token (aborted): the decode
        side stops waiting and prefills itself."""
        streaming = self.streaming.pop(request_id, None)
        if streaming is not None:
            assert self.sender is not None
            self.sender.finish_stream(streaming.stream, None)

    def hold(
        self,
        request: Request,
        block_ids: list[int],
        first_logprobs: dict[int, Logprob] | None,
        generator: torch.Generator | None,
    ) -> dict[str, Any]:
        """Keep a finished prompt's blocks for a decode instance; the params it needs. A
        streaming request's blocks are copied out instead (the caller frees them at once),
        and the params end its stream."""
        assert self.sender is not None
        streaming = self.streaming.get(request.request_id)
        if streaming is None:
            self.sender.hold(request.request_id, block_ids)
        else:
            self.stage(request, block_ids, request.num_prompt_tokens)
            del self.streaming[request.request_id]
        rows = None
        if first_logprobs is not None:
            rows = [[token_id, lp.logprob, lp.rank] for token_id, lp in first_logprobs.items()]
        state = None
        if generator is not None:
            state = base64.b64encode(generator.get_state().numpy().tobytes()).decode()
        params = RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_host=self.config.host,
            remote_port=self.config.port,
            remote_request_id=request.request_id,
            remote_block_ids=block_ids,
            block_size=self.block_size,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            first_token_id=request.output_token_ids[0],
            first_logprobs=rows,
            generator_state=state,
            num_cached_tokens=request.num_cached_tokens,
            transfer_id=None if streaming is None else streaming.stream.transfer_id,
        ).to_dict()
        if streaming is not None:
            self.sender.finish_stream(streaming.stream, params)
        return params

    def take_released(self) -> list[str]:
        """Prefill side: requests whose held blocks can be freed."""
        return [] if self.sender is None else self.sender.take_released()

    # -- decode side ------------------------------------------------------------------------

    def start(self, loads: list[KVLoad]) -> list[KVLoad]:
        """Start pulling; returns the loads with nothing to pull (all local hits), which the
        caller lands at once (the prefill instance is told to free those blocks)."""
        assert self.receiver is not None
        empty = []
        for load in loads:
            self.load_stats.num_cached_blocks += load.first_block
            if load.block_ids or isinstance(load.remote, RemoteStream):  # its first token too
                self.receiver.load(load)
            else:
                self.receiver.release(load.remote)
                empty.append(load)
        return empty

    def release(self, remote: Remote) -> None:
        """Decode side: the request will not pull its KV, or no longer (it ended at its first
        token, or was aborted)."""
        assert self.receiver is not None
        self.receiver.release(remote)

    def count_failed_landing(self, result: LoadResult) -> None:
        """A stream arrived whole but its end could not be used: a failed load after all."""
        stats = self.load_stats
        stats.num_loaded -= 1
        stats.num_failed += 1
        stats.num_blocks -= result.num_blocks
        stats.num_bytes -= result.num_bytes

    def take_results(self) -> list[LoadResult]:
        if self.receiver is None:
            return []
        results = self.receiver.take_results()
        stats = self.load_stats
        for result in results:
            stats.seconds += result.seconds
            if result.ok:
                stats.num_loaded += 1
                stats.num_blocks += result.num_blocks
                stats.num_bytes += result.num_bytes
            else:
                stats.num_failed += 1
        return results
