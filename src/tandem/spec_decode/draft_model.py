"""Draft-model proposer: a smaller or cheaper model that shares the target's tokenizer guesses
the next tokens greedily: a batched forward for the first guess, then the rest in one fused
call of multi-step forwards where the CPU's decode step runs them (else a forward per guess).
The embedded model with its packed 4-bit weights drafting for its own float32 self needs no
download.

The draft keeps its own paged KV cache with as many blocks as the target's and reads it through
the target's block tables, so a request's blocks (allocated, shared by prefix, freed, preempted)
follow the block manager's one set of rules. A draft guess at position p is written into the
slot the target will verify it at; the proposer grows the request's table for its guesses
before it writes them. Only tokens the target has accepted count as computed by the draft:
rejected guesses' slots are simply written again. A request the draft has not seen (new,
preempted, resumed) is caught up over its context in the first draft step, batched with the
others, from the end of the blocks it shares by prefix whose content the draft has computed
(kept per block with the block's generation, so content evicted since is never taken).

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
        # Block id -> its generation (core/block_pool.py) when the draft's KV covered the
        # block's whole cached content: a request that finds the block by prefix finds the
        # draft's KV too. Dropping the block's content bumps its generation.
        self._cached_blocks: dict[int, int] = {}
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
        position, guessing = 1, [(r, limit) for r, limit in pairs if limit > 1]
        while guessing:  # the forwards propose runs after the first
            min_limit = min(limit for _, limit in guessing)
            num_steps = self._num_steps(len(guessing), min_limit, position)
            guesses = BatchSums()
            for request, _ in guessing:
                guesses += request_sums(request.num_tokens - 1 + position, 1, True)
            seconds += self.cost_model.predict(guesses, num_steps)
            position += num_steps
            guessing = [(r, limit) for r, limit in guessing if limit > position]
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
        backlogs, slices, computed_before = [], [], []
        for _, request, _ in active:
            computed = self._computed(request)
            computed_before.append(computed)
            steady_start = self._steady_start(request, computed)
            if computed < steady_start:
                token_ids = request.all_token_ids[:steady_start]
                backlogs.append(self._slice(request, token_ids, computed, sample=False))
            slices.append(self._slice(request, request.all_token_ids, steady_start))
        if backlogs:
            start = time.perf_counter()
            self._catch_up(backlogs)
            self.catch_up_seconds = time.perf_counter() - start
        guessed = [[guess] for guess in self._greedy(slices)]
        for (_, request, _), computed in zip(active, computed_before, strict=True):
            self._note_cached_blocks(request, computed)
            self._num_computed[request.request_id] = request.num_tokens
        position = 0  # guesses every active request has
        while True:
            for (index, _, _), guesses in zip(active, guessed, strict=True):
                drafts[index] += guesses
            position += len(guessed[0])
            active = [entry for entry in active if entry[2] > position]
            if not active:
                return drafts
            slices = []
            for index, request, _ in active:
                token_ids = [*request.all_token_ids, *drafts[index]]
                slices.append(self._slice(request, token_ids, len(token_ids) - 1))
            num_steps = self._num_steps(len(slices), min(e[2] for e in active), position)
            if num_steps > 1:
                guessed = self._greedy_steps(slices, num_steps)
            else:
                guessed = [[guess] for guess in self._greedy(slices)]

    def _num_steps(self, num_requests: int, min_limit: int, position: int) -> int:
        """How many guesses each of these requests, `position` guessed each, gets from the
        next call: as many as all still want in one fused burst where the runner has one for
        this many rows, else one."""
        if num_requests <= self.runner.max_burst_rows:
            return max(min_limit - position, 1)
        return 1

    def _computed(self, request: Request) -> int:
        """The request's tokens whose draft KV is in the cache (at most all but its last)."""
        computed = self._num_computed.get(request.request_id)
        if computed is None:
            computed = self._cached_prefix(request)
        return min(computed, request.num_tokens - 1)

    def _cached_prefix(self, request: Request) -> int:
        """Of a request the draft has not seen, the tokens at its start whose draft KV is in
        the cache: the blocks it shares by prefix whose content the draft has computed."""
        num_blocks = 0
        for block in self.kv_cache_manager.held_blocks.get(request.request_id, ()):
            if block.block_hash is None or (
                self._cached_blocks.get(block.block_id) != block.generation
            ):
                break
            num_blocks += 1
        return num_blocks * self.kv_cache_manager.block_size

    def _note_cached_blocks(self, request: Request, computed_before: int) -> None:
        """Note the request's cached blocks the draft's KV now covers whole: those its forwards
        just reached from `computed_before` (and the one before, which the target may have
        cached only since)."""
        size = self.kv_cache_manager.block_size
        blocks = self.kv_cache_manager.held_blocks.get(request.request_id, [])
        first = max(computed_before // size - 1, 0)
        for block in blocks[first : request.num_tokens // size]:
            if block.block_hash is not None:
                self._cached_blocks[block.block_id] = block.generation

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
        run = self.runner.run(slices, argmax=True)
        argmax = run.logits.argmax(dim=-1) if run.argmax is None else run.argmax
        self.cost_model.observe(batch_sums(slices), time.perf_counter() - start)
        return argmax.tolist()

    def _greedy_steps(self, slices: list[ScheduledRequest], num_steps: int) -> list[list[int]]:
        """`num_steps` guesses of each request (one token each) in one call: the CPU's fused
        decode steps, each fed the argmax of the one before (multi-step scheduling's
        forwards), with no Python between them."""
        start = time.perf_counter()
        guesses = self.runner.decode_steps(slices, num_steps, [frozenset()] * len(slices))
        seconds = time.perf_counter() - start
        self.cost_model.observe(batch_sums(slices), seconds, num_steps=num_steps)
        return guesses
