"""The waiting queue, in the order requests are admitted (vLLM's `scheduling_policy`):

- `fcfs`: arrival order; a preempted request goes back to the front;
- `priority`: lowest `priority` value first, then earliest arrival, then the order of
  `add_request` (a total order, so ties never depend on the heap's layout). A preempted request
  takes its place by the same key.

Both are plain Python over `Request`s, like the rest of core/.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Literal, Protocol

from tandem.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")

PriorityKey = Callable[[Request], tuple]


class RequestQueue(Protocol):
    def add(self, request: Request) -> None:
        """A new request, behind those already waiting (by the queue's order)."""

    def prepend(self, requests: Iterable[Request]) -> None:
        """Requests that were waiting or running before (preempted, or skipped this step): in
        front of new arrivals, keeping their own order (fcfs); by their key (priority)."""

    def peek(self) -> Request:
        """The next request to admit."""

    def pop(self) -> Request:
        """Remove and return the next request to admit."""

    def discard_finished(self) -> None:
        """Drop requests that finished (were aborted) while waiting."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, requests: Iterable[Request]) -> None:
        self._queue.extendleft(reversed(list(requests)))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def discard_finished(self) -> None:
        self._queue = deque(r for r in self._queue if not r.is_finished)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """A heap of (key, request); `key` must order every pair of requests strictly."""

    def __init__(self, key: PriorityKey) -> None:
        self._key = key
        self._heap: list[tuple[tuple, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    def prepend(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def discard_finished(self) -> None:
        self._heap = [entry for entry in self._heap if not entry[1].is_finished]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


def make_request_queue(policy: SchedulingPolicy, key: PriorityKey) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(key)
    raise ValueError(
        f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}"
    )
