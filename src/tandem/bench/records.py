"""One request's record: every timestamp the load generator took and the server's token
counts. Times are seconds of `time.perf_counter()` since the run's start; report.py derives
every figure from these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int  # order in the workload (sessions, then turns)
    session: int
    turn: int
    tag: str
    prompt_len: int  # the workload's words or token ids (the server's count: prompt_tokens)
    output_len: int  # max_tokens asked for
    scheduled: float  # when the arrival process released it
    send: float = math.nan  # when it was sent (later than scheduled while --max-concurrency waits)
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk carrying output
    end: float = math.nan  # when the response ended, or failed
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None  # from the server's usage
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_output_tokens(self) -> int:
        """The server's count when it gave one, else one token per chunk."""
        return self.output_tokens if self.output_tokens is not None else len(self.chunks)

    def to_dict(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        for key in ("scheduled", "send", "end"):
            data[key] = None if math.isnan(data[key]) else round(data[key], 6)
        data["chunks"] = [round(t, 6) for t in self.chunks]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        data = dict(data)
        for key in ("scheduled", "send", "end"):
            data[key] = math.nan if data.get(key) is None else data[key]
        return cls(**data)
