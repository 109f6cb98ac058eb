"""The decode side: pulls the blocks a request lacks from the prefill instance that holds them.
Each prefill peer gets a thread that owns the control socket and the pair group to it, formed
on first use and formed again after a failure; it writes received blocks straight into the
KV cache (blocks the scheduler allocated to the request and nobody else reads until the load
is reported done) and reports each load's outcome to the engine core. A streamed load (the
prompt is still being computed there) gets a thread of its own and a tag on the pair group,
so it holds up no other load from that peer while it waits for the prompt's chunks."""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import zmq
from torch.distributed import ProcessGroupGloo

from tandem.kv_transfer.channel import (
    block_bytes,
    blocks_per_chunk,
    cache_layout,
    chunk_ranges,
    empty_chunk,
    pair_group,
    scatter_blocks,
)
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.messages import (
    STATUS_DONE,
    STATUS_MISMATCH,
    STATUS_OK,
    STATUS_WAIT,
    TAG,
    Hello,
    Pull,
    Release,
    StreamPull,
    Welcome,
)
from tandem.kv_transfer.params import KVLoad, Remote, prompt_digest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    ok: bool
    num_blocks: int
    num_bytes: int
    seconds: float
    error: str | None = None
    final: dict[str, Any] | None = None  # a stream's RemotePrefill dict, sent at its end


class _Peer:
    """One prefill instance, from one decode instance's side."""

    def __init__(self, receiver: KVReceiver, host: str, port: int) -> None:
        self.receiver = receiver
        self.host, self.port = host, port
        self.jobs: queue.SimpleQueue[KVLoad | Release] = queue.SimpleQueue()
        self.socket: zmq.Socket | None = None
        self.group: ProcessGroupGloo | None = None  # this thread's to set
        # Stream threads that saw a group break say so here; the next load forms a new one.
        self.broken_groups: set[ProcessGroupGloo] = set()
        self.tags = itertools.count(TAG + 1)  # one per streamed load
        threading.Thread(
            target=self._run, name=f"tandem-kv-recv-{host}:{port}", daemon=True
        ).start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if isinstance(job, Release):
                self._send_control(job)
                continue
            start = time.perf_counter()
            try:
                group = self._connect()
                if job.remote.transfer_id is not None:
                    self._start_stream(group, job, start)
                    continue
                self._load(group, job)
            except Exception as error:
                self._disconnect()
                result = self._failed(job, start, error)
            else:
                num_blocks = len(job.block_ids)
                num_bytes = num_blocks * block_bytes(self.receiver.kv_caches)
                result = LoadResult(
                    job.request_id, True, num_blocks, num_bytes, time.perf_counter() - start
                )
            self.receiver._finished(result)

    @staticmethod
    def _failed(job: KVLoad, start: float, error: Exception) -> LoadResult:
        return LoadResult(job.request_id, False, 0, 0, time.perf_counter() - start,
                          f"{type(error).__name__}: {error}")  # fmt: skip

    def _start_stream(self, group: ProcessGroupGloo, load: KVLoad, start: float) -> None:
        """Ask for the stream here (this thread owns the control socket), then receive it on a
        thread of its own."""
        tag = next(self.tags)
        self._send_control(
            StreamPull(
                self.receiver.peer_id, load.remote.transfer_id, tag, load.first_block,
                len(load.prompt_token_ids), prompt_digest(load.prompt_token_ids),
                self.receiver.config.timeout,
            )
        )  # fmt: skip
        threading.Thread(
            target=self._stream, args=(group, load, tag, start),
            name=f"tandem-kv-stream-{load.request_id}", daemon=True,
        ).start()  # fmt: skip

    def _stream(self, group: ProcessGroupGloo, load: KVLoad, tag: int, start: float) -> None:
        """Receive a stream's chunks into the request's blocks as they come, in order and each
        block once, then the RemotePrefill dict that ends it (only once every block is in)."""
        caches = self.receiver.kv_caches
        header = torch.empty(4, dtype=torch.int64)
        num_blocks = 0  # received: blocks [first_block, first_block + num_blocks)
        try:
            while True:
                group.recv([header], 0, tag).wait()
                status, first, count, size = header.tolist()
                if status == STATUS_WAIT:
                    continue
                if status == STATUS_OK:
                    local = first - load.first_block
                    if local != num_blocks or count < 1 or local + count > len(load.block_ids):
                        raise ValueError(
                            f"blocks {first}..{first + count} came where block "
                            f"{load.first_block + num_blocks} was due"
                        )
                    chunk = empty_chunk(caches, count)
                    group.recv([chunk], 0, tag).wait()
                    ids = torch.tensor(load.block_ids[local : local + count], dtype=torch.int64)
                    scatter_blocks(caches, ids, chunk)
                    num_blocks += count
                    continue
                if status == STATUS_DONE:
                    if num_blocks != len(load.block_ids):
                        raise ValueError(
                            f"the stream ended with {num_blocks} of {len(load.block_ids)} blocks"
                        )
                    payload = torch.empty(size, dtype=torch.uint8)
                    group.recv([payload], 0, tag).wait()
                    final = msgspec.msgpack.decode(payload.numpy().tobytes())
                    break
                if status == STATUS_MISMATCH:
                    raise ValueError(
                        f"transfer {load.remote.transfer_id} computed another prompt than "
                        "this request's (the two legs of a request must carry the same prompt)"
                    )
                raise LookupError(f"the prefill instance has no transfer {load.remote.transfer_id}")
            if caches[0].is_cuda:
                torch.cuda.current_stream(caches[0].device).synchronize()
        except Exception as error:
            if not isinstance(error, LookupError | ValueError):
                self.broken_groups.add(group)  # the next load forms a new pair group
            result = self._failed(load, start, error)
        else:
            num_bytes = num_blocks * block_bytes(caches)
            seconds = time.perf_counter() - start
            result = LoadResult(load.request_id, True, num_blocks, num_bytes, seconds, None, final)
        self.receiver._finished(result)

    def _send_control(self, message: Pull | StreamPull | Release | Hello) -> None:
        if self.socket is None:
            self.socket = self.receiver.context.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.LINGER, 0)
            self.socket.connect(f"tcp://{self.host}:{self.port}")
        self.socket.send(self.receiver.encoder.encode(message))

    def _connect(self) -> ProcessGroupGloo:
        """The pair group to the prefill instance, formed now if there is none (or the one
        there is broke under a stream)."""
        if self.group is not None and self.group not in self.broken_groups:
            return self.group
        receiver = self.receiver
        # ZeroMQ would wait out the timeout for a prefill instance that is gone; TCP says so
        # at once (connection refused), and the request is prefilled here without delay.
        socket.create_connection((self.host, self.port), timeout=receiver.config.timeout).close()
        self._send_control(Hello(receiver.peer_id, receiver.layout))
        assert self.socket is not None
        if not self.socket.poll(int(receiver.config.timeout * 1000)):
            raise TimeoutError(
                f"the prefill instance at {self.host}:{self.port} did not answer within "
                f"{receiver.config.timeout:.0f} s"
            )
        welcome = msgspec.msgpack.decode(self.socket.recv(), type=Welcome)
        if welcome.error is not None:
            raise RuntimeError(welcome.error)
        self.group = pair_group(
            self.host, welcome.store_port, welcome.pair_name, 1, receiver.config.host,
            receiver.config.timeout,
        )  # fmt: skip
        return self.group

    def _disconnect(self) -> None:
        self.group = None
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None

    def _load(self, group: ProcessGroupGloo, load: KVLoad) -> None:
        receiver = self.receiver
        num_blocks = len(load.block_ids)
        self._send_control(
            Pull(receiver.peer_id, load.remote.remote_request_id, load.first_block, num_blocks)
        )
        header = torch.empty(2, dtype=torch.int64)
        group.recv([header], 0, TAG).wait()
        status, num_sent = header.tolist()
        if status != STATUS_OK or num_sent != num_blocks:
            raise LookupError(
                f"the prefill instance no longer holds request {load.remote.remote_request_id} "
                "(its hold expired, or it restarted)"
            )
        block_ids = torch.tensor(load.block_ids, dtype=torch.int64)
        caches = receiver.kv_caches
        ranges = chunk_ranges(num_blocks, receiver.blocks_per_chunk)
        # Two receives posted ahead, so the wire stays busy while a chunk is written.
        posted = []
        for start, stop in ranges[:2]:
            chunk = empty_chunk(caches, stop - start)
            posted.append((group.recv([chunk], 0, TAG), chunk, start, stop))
        next_range = 2
        while posted:
            work, chunk, start, stop = posted.pop(0)
            work.wait()
            if next_range < len(ranges):
                follow_start, follow_stop = ranges[next_range]
                follow = empty_chunk(caches, follow_stop - follow_start)
                posted.append((group.recv([follow], 0, TAG), follow, follow_start, follow_stop))
                next_range += 1
            scatter_blocks(caches, block_ids[start:stop], chunk)
        if caches[0].is_cuda:
            torch.cuda.current_stream(caches[0].device).synchronize()


class KVReceiver:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: Sequence[torch.Tensor],
        notify: Callable[[], None],
    ) -> None:
        """`notify`: called (from a transfer thread) when a load has finished."""
        self.config = config
        self.kv_caches = list(kv_caches)
        self.layout = cache_layout(self.kv_caches)
        self.blocks_per_chunk = blocks_per_chunk(self.kv_caches, config.chunk_bytes)
        self.notify = notify
        self.peer_id = uuid.uuid4().hex
        self.context = zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()
        logger.info("KV transfer: decode role, pulling as %s from %s", self.peer_id, config.host)

    def load(self, load: KVLoad) -> None:
        self._peer(load.remote).jobs.put(load)

    def release(self, remote: Remote) -> None:
        """Tell the prefill instance to free a request's blocks (or end its stream): they
        will not be pulled, or no longer."""
        if remote.transfer_id is not None:
            message = Release([], [remote.transfer_id])
        else:
            message = Release([remote.remote_request_id])
        self._peer(remote).jobs.put(message)

    def take_results(self) -> list[LoadResult]:
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def _peer(self, remote: Remote) -> _Peer:
        key = (remote.remote_host, remote.remote_port)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(self, *key)
        return peer

    def _finished(self, result: LoadResult) -> None:
        if not result.ok:
            logger.warning(
                "KV load of request %s failed after %.2f s (%s): prefilling it here",
                result.request_id, result.seconds, result.error,
            )  # fmt: skip
        self._results.put(result)
        self.notify()
