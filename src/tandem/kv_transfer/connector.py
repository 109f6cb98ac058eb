"""The engine core's handle on disaggregation: what a request's kv_transfer_params ask of this
instance, what a prefill instance answers, and the loads a decode instance starts and lands.
The core calls it from its own thread only; the transfers run on the sender's and receiver's
threads and wake the core (`set_wake`) when they have news."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.params import (
    KVLoad,
    RemotePrefill,
    check_kv_transfer,
    prompt_digest,
    wants_remote_decode,
)
from tandem.kv_transfer.receiver import KVReceiver, LoadResult
from tandem.kv_transfer.sender import KVSender
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

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` is called from transfer threads when take_* has news for the core."""
        self._wake = wake

    def _notify(self) -> None:
        self._wake()

    def accept(
        self, request: Request, params: dict[str, Any], vocab_size: int
    ) -> RemotePrefill | None:
        """Read a request's kv_transfer_params (params.check_kv_transfer). Prefill side: the
        request keeps its prompt's blocks when it finishes. Decode side: the place its
        prompt's KV waits, and its first token (returned)."""
        params_of_request = request.sampling_params
        remote = check_kv_transfer(
            params, self.role, request.prompt_token_ids, params_of_request.max_tokens,
            params_of_request.logprobs is not None, self.block_size, vocab_size,
        )  # fmt: skip
        if wants_remote_decode(params):
            request.hold_kv = True
        return remote

    # -- prefill side -----------------------------------------------------------------------

    def hold(
        self,
        request: Request,
        block_ids: list[int],
        first_logprobs: dict[int, Logprob] | None,
        generator: torch.Generator | None,
    ) -> dict[str, Any]:
        """Keep a finished prompt's blocks for a decode instance; the params it needs."""
        assert self.sender is not None
        self.sender.hold(request.request_id, block_ids)
        rows = None
        if first_logprobs is not None:
            rows = [[token_id, lp.logprob, lp.rank] for token_id, lp in first_logprobs.items()]
        state = None
        if generator is not None:
            state = base64.b64encode(generator.get_state().numpy().tobytes()).decode()
        return RemotePrefill(
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
        ).to_dict()

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
            if load.block_ids:
                self.receiver.load(load)
            else:
                self.receiver.release(load.remote)
                empty.append(load)
        return empty

    def release(self, remote: RemotePrefill) -> None:
        """Decode side: the request will not pull its KV (it ended at its first token)."""
        assert self.receiver is not None
        self.receiver.release(remote)

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
