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

What the draft costs is learned as the target's steps are (a StepCostModel of its own, fed by
each of its forwards), so the engine can ask before guessing whether guesses would pay: a
step's guessing costs `forecast_seconds`' steady part (the tokens accepted since the last
guess and one forward per further guess), and a request's backlog beyond that (a new request's
prompt, or the tokens of steps that verified no drafts) is paid once, timed apart as
`catch_up_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tandem.core.roofline import BatchSums, batch_sums, request_sums
from tandem.core.scheduler import ScheduledRequest
from tandem.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tandem.core.kv_cache_manager import KVCacheManager
    from tandem.core.step_cost import StepCostModel
    from tandem.request import Request


class DraftModelProposer:
    costly = True

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache_manager: KVCacheManager,
        cost_model: StepCostModel,
        num_speculative_tokens: int,
    ) -> None:
        self.runner = runner
        self.kv_cache_manager = kv_cache_manager
        self.cost_model = cost_model
        # The most tokens a request gains in a step that verified drafts: more since the draft
        # last guessed for it is a backlog.
        self.max_steady_tokens = 1 + num_speculative_tokens
        # Request id -> tokens whose draft KV is in the cache (all accepted by the target).
        self._num_computed: dict[str, int] = {}
        # Of the last propose: the seconds its backlogs took (see the module's docstring).
        self.catch_up_seconds = 0.0

    def forget(self, request_id: str) -> None:
        self._num_computed.pop(request_id, None)

    def forecast_seconds(
        self, requests: Sequence[Request], max_tokens: Sequence[int]
    ) -> tuple[float, float] | None:
        """What guessing up to `max_tokens` tokens for each request would cost by the draft's
        cost model, as (each step's part, the backlogs' once-only part); None until the model
        has fitted its line to forwards seen (the roofline alone is not a forecast)."""
        if self.cost_model.coefficients is None:
            return None
        first, backlog = BatchSums(), BatchSums()
        pairs = list(zip(requests, max_tokens, strict=True))
        for request, limit in pairs:
            if limit > 0:
                computed = self._computed(request)
                steady_start = self._steady_start(request, computed)
                first += request_sums(steady_start, request.num_tokens - steady_start, True)
                if computed < steady_start:
                    backlog += request_sums(computed, steady_start - computed, False)
        seconds = self.cost_model.predict(first)
        for position in range(1, max(max_tokens, default=0)):
            guesses = BatchSums()
            for request, limit in pairs:
                if limit > position:
                    guesses += request_sums(request.num_tokens - 1 + position, 1, True)
            seconds += self.cost_model.predict(guesses)
        once = self.cost_model.predict(backlog) if backlog.num_new_tokens else 0.0
        return seconds, once

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        self.catch_up_seconds = 0.0
        drafts: list[list[int]] = [[] for _ in requests]
        active = []
        for index, (request, limit) in enumerate(zip(requests, max_tokens, strict=True)):
            # Slots for the guesses the draft writes (all but the last): num_computed + limit.
            if limit > 0 and self.kv_cache_manager.allocate_slots(request, limit) is not None:
                active.append((index, request, limit))
        if not active:
            return drafts
        backlogs, slices = [], []
        for _, request, _ in active:
            computed = self._computed(request)
            steady_start = self._steady_start(request, computed)
            if computed < steady_start:
                token_ids = request.all_token_ids[:steady_start]
                backlogs.append(self._slice(request, token_ids, computed, sample=False))
            slices.append(self._slice(request, request.all_token_ids, steady_start))
            self._num_computed[request.request_id] = request.num_tokens
        if backlogs:
            start = time.perf_counter()
            self._catch_up(backlogs)
            self.catch_up_seconds = time.perf_counter() - start
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

    def _computed(self, request: Request) -> int:
        """The request's tokens whose draft KV is in the cache (at most all but its last)."""
        return min(self._num_computed.get(request.request_id, 0), request.num_tokens - 1)

    def _steady_start(self, request: Request, computed: int) -> int:
        """Where the step's own part of the request's first draft forward starts: the tokens
        before it are a backlog."""
        return max(computed, request.num_tokens - self.max_steady_tokens)

    def _slice(
        self, request: Request, token_ids: list[int], num_computed: int, sample: bool = True
    ) -> ScheduledRequest:
        """One request's part of a draft step: from `num_computed` to the end of `token_ids`,
        sampling at the last (or not: a backlog's forward only writes KV)."""
        return ScheduledRequest(
            request.request_id,
            token_ids,
            num_computed,
            len(token_ids) - num_computed,
            self.kv_cache_manager.get_block_ids(request.request_id),
            sample=sample,
            draft_token_ids=[],
        )

    def _catch_up(self, slices: list[ScheduledRequest]) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            self.runner.hidden_states(self.runner.prepare(slices, [False] * len(slices)))
        self.cost_model.observe(batch_sums(slices), time.perf_counter() - start)

    def _greedy(self, slices: list[ScheduledRequest]) -> list[int]:
        start = time.perf_counter()
        guesses = self.runner.execute(slices).argmax(dim=-1).tolist()
        self.cost_model.observe(batch_sums(slices), time.perf_counter() - start)
        return guesses
