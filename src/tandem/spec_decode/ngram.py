"""Prompt lookup (n-gram) proposer: if the last n tokens of a request appeared earlier in its
prompt or output, guess that what followed them then follows again. Free to run, and right
often when the output copies from the input (summaries, edits, extraction, code).

Each request's tokens are mirrored in a numpy array grown in place (tokens only ever append),
so a step costs one pass over the positions holding the last token, not over the whole list
in Python."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from tandem.request import Request


class Proposer(Protocol):
    """Guesses the next tokens of requests; trained heads or draft models plug in here."""

    # Proposing costs real compute (a draft model): skip it while the scheduler verifies none,
    # and where forecast_seconds says its guesses cannot pay.
    costly: bool
    # Of the last propose: the seconds spent on backlogs, paid once (a new request's prompt).
    catch_up_seconds: float

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        """For each request, at most that many guesses of the tokens after its last one."""
        ...

    def forget(self, request_id: str) -> None:
        """The request has finished, or lost its KV (preempted): drop what is kept for it."""
        ...

    def forecast_seconds(
        self, requests: Sequence[Request], max_tokens: Sequence[int]
    ) -> tuple[float, float] | None:
        """What proposing for these requests would cost: (each step's part, the once-only
        part of their backlogs), or None while the proposer cannot tell."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}

    costly = False
    catch_up_seconds = 0.0

    def forecast_seconds(
        self, requests: Sequence[Request], max_tokens: Sequence[int]
    ) -> tuple[float, float] | None:
        return 0.0, 0.0

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[list[int]]:
        return [
            self.propose_one(r.request_id, r.all_token_ids, limit)
            for r, limit in zip(requests, max_tokens, strict=True)
        ]

    def propose_one(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = self._mirror(request_id, token_ids)
        return find_continuation(tokens, self.min_n, self.max_n, max_tokens)

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._lengths.pop(request_id, None)

    def _mirror(self, request_id: str, token_ids: Sequence[int]) -> np.ndarray:
        """The request's tokens as an array view, appending only what is new since last time."""
        length = len(token_ids)
        known = self._lengths.get(request_id, 0)
        buffer = self._tokens.get(request_id)
        if buffer is None or len(buffer) < length:
            grown = np.empty(max(2 * length, 64), dtype=np.int64)
            if buffer is not None:
                grown[:known] = buffer[:known]
            buffer = self._tokens[request_id] = grown
        if known < length:
            buffer[known:length] = token_ids[known:length]
        self._lengths[request_id] = length
        return buffer[:length]


def find_continuation(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of min_n..max_n tokens (up to `max_tokens` of them); [] when no such suffix
    occurred before. An occurrence may overlap the suffix (a repeating pattern)."""
    length = len(tokens)
    if length <= min_n:
        return []
    # Candidate ends: earlier positions holding the last token (not the last position itself).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if len(ends) == 0:
        return []
    # Grow each candidate's match backwards, one position at a time, up to max_n tokens.
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return []
    # The latest candidate among the longest matches: recent context predicts best.
    end = int(ends[np.flatnonzero(match_len == best)[-1]])
    return tokens[end + 1 : end + 1 + max_tokens].tolist()
