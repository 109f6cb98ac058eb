"""Draft-model proposer: a smaller or cheaper model that shares the target's tokenizer guesses
the next tokens greedily, one batched forward per guess. The embedded model with its packed
4-bit weights drafting for its own float32 self needs no download.

The draft keeps its own paged KV cache with as many blocks as the target's and reads it through
the target's block tables, so a request's blocks (allocated, shared by prefix, freed, preempted)
follow the block manager's one set of rules. A draft guess at position p is written into the
slot the target will verify it at; the proposer grows the request's table for its guesses
before it writes them. Only tokens the target has accepted count as computed by the draft:
rejected guesses' slots are simply written again. A request the draft has not seen (new,
preempted, resumed) is caught up over its whole context in the first draft step, batched with
the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem.core.scheduler import ScheduledRequest
from tandem.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tandem.core.kv_cache_manager import KVCacheManager
    from tandem.request import Request


class DraftModelProposer:
    costly = True

    def __init__(self, runner: ModelRunner, kv_cache_manager: KVCacheManager) -> None:
        self.runner = runner
        self.kv_cache_manager = kv_cache_manager
        # Request id -> tokens whose draft KV is in the cache (all accepted by the target).
        self._num_computed: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self._num_computed.pop(request_id, None)

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = []
        for index, (request, limit) in enumerate(zip(requests, max_tokens, strict=True)):
            # Slots for the guesses the draft writes (all but the last): num_computed + limit.
            if limit > 0 and self.kv_cache_manager.allocate_slots(request, limit) is not None:
                active.append((index, request, limit))
        if not active:
            return drafts
        slices = []
        for _, request, _ in active:
            computed = min(self._num_computed.get(request.request_id, 0), request.num_tokens - 1)
            slices.append(self._slice(request, request.all_token_ids, computed))
            self._num_computed[request.request_id] = request.num_tokens
        guesses = self._greedy(slices)
        for position in range(1, max(limit for _, _, limit in active) + 1):
            for (index, _, _), guess in zip(active, guesses, strict=True):
                drafts[index].append(guess)
            active = [entry for entry in active if entry[2] > position]
            if not active:
                break
            slices = []
            for index, request, _ in active:
                token_ids = [*request.all_token_ids, *drafts[index]]
                slices.append(self._slice(request, token_ids, len(token_ids) - 1))
            guesses = self._greedy(slices)
        return drafts

    def _slice(self, request: Request, token_ids: list[int], num_computed: int) -> ScheduledRequest:
        """One request's part of a draft step: from `num_computed` to the end of `token_ids`,
        sampling at the last."""
        return ScheduledRequest(
            request.request_id,
            token_ids,
            num_computed,
            len(token_ids) - num_computed,
            self.kv_cache_manager.get_block_ids(request.request_id),
            sample=True,
            draft_token_ids=[],
        )

    def _greedy(self, slices: list[ScheduledRequest]) -> list[int]:
        return self.runner.execute(slices).argmax(dim=-1).tolist()
