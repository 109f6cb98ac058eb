"""The prefill side: keeps finished prompts' blocks and sends them to the decode instances that
pull them. A control thread answers ZeroMQ messages; each decode peer gets a thread that owns
its pair group and sends one request's blocks after another. Blocks are freed only by the
engine core's thread (the block pool is not thread-safe): this side reports which requests it
is done with, and the core releases them.

Streams (a prefill leg with a transfer id) need no held blocks: the engine core copies each
block out once a step has computed it (`stage`), and a thread per streamed pull sends the
copies as they come, on the pull's own tag, so a stream waiting for its prompt's next chunk
holds up no other transfer to the same peer."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    gather_blocks,
    host_store,
    pair_group,
    send_stream_header,
)
from tandem.kv_transfer.config import KVTransferConfig
from tandem.kv_transfer.messages import (
    STATUS_DONE,
    STATUS_MISMATCH,
    STATUS_OK,
    STATUS_UNKNOWN,
    STATUS_WAIT,
    TAG,
    ControlMessage,
    Hello,
    Pull,
    Release,
    StreamPull,
    Welcome,
)

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    block_ids: list[int]
    expires_at: float
    sending: bool = False


@dataclass
class StagedStream:
    """One transfer's blocks, copied out as its prompt is computed. Made by whichever comes
    first: the prefill request (`open_stream`) or the decode side's pull."""

    transfer_id: str
    active_at: float  # made, opened, or last staged: a stream silent too long has stalled
    chunks: deque[tuple[int, torch.Tensor]] = field(default_factory=deque)  # (first block, KV)
    prompt: tuple[int, str] | None = None  # (number of prompt tokens, digest), once it came
    final: bytes | None = None  # the RemotePrefill dict, msgpack: the prompt is done
    failed: bool = False  # aborted or released: nothing more comes
    pulled: bool = False  # a decode instance pulls it (one only: a second is refused)
    ended_at: float | None = None  # when final or failed was set
    gone: bool = False  # out of the sender's table: staging into it is pointless


class _Pair:
    """A decode peer: the pulls its thread serves one after another, and its pair group once
    formed (streamed pulls send on it from threads of their own)."""

    def __init__(self) -> None:
        self.pulls: queue.SimpleQueue[Pull | None] = queue.SimpleQueue()  # None: replaced
        self.group: ProcessGroupGloo | None = None
        self.formed = threading.Event()


@dataclass
class SenderStats:
    num_sent: int = 0  # requests whose blocks went to a decode instance
    num_sent_blocks: int = 0
    sent_bytes: int = 0
    num_expired: int = 0  # held past hold_seconds without a pull


class KVSender:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: Sequence[torch.Tensor],
        notify: Callable[[], None],
    ) -> None:
        """`notify`: called (from a transfer thread) when requests are ready to release."""
        self.config = config
        self.kv_caches = list(kv_caches)
        self.layout = cache_layout(self.kv_caches)
        self.blocks_per_chunk = blocks_per_chunk(self.kv_caches, config.chunk_bytes)
        self.notify = notify
        self.stats = SenderStats()
        self._held: dict[str, _Held] = {}
        self._streams: dict[str, StagedStream] = {}
        # Transfer ids released or ended, for a while: a pull or prefill leg that comes late
        # for one is answered at once (refused, or not staged) instead of waiting for it. In
        # the order they ended, so forgetting the old ones costs only them.
        self._ended_ids: dict[str, None] = {}
        self._ended_order: deque[tuple[float, str]] = deque()
        self._lock = threading.Lock()
        self._stream_changed = threading.Condition(self._lock)
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pair_ids = itertools.count()
        self._store = host_store(config.host, config.port + 1, config.timeout)
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._control.bind(f"tcp://{config.host}:{config.port}")
        threading.Thread(target=self._serve_control, name="tandem-kv-control", daemon=True).start()
        logger.info(
            "KV transfer: prefill role, control on %s:%d, pair groups meet at port %d",
            config.host, config.port, config.port + 1,
        )  # fmt: skip

    # -- the engine core's thread -----------------------------------------------------------

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._held[request_id] = _Held(block_ids, time.monotonic() + self.config.hold_seconds)

    def open_stream(self, transfer_id: str, num_prompt_tokens: int, digest: str) -> StagedStream:
        """A prefill request with a transfer id has come: its blocks will be staged into the
        returned stream (not staged if its decode side has already given up on it)."""
        now = time.monotonic()
        with self._stream_changed:
            stream = self._streams.get(transfer_id)
            if stream is not None and stream.prompt is not None:
                raise ValueError(
                    f"kv_transfer_params.transfer_id {transfer_id!r} is already in use: "
                    "give each prefill leg an id of its own"
                )
            if stream is None:
                stream = StagedStream(transfer_id, now)
                if transfer_id in self._ended_ids:
                    stream.failed = stream.gone = True
                else:
                    self._streams[transfer_id] = stream
            stream.prompt = (num_prompt_tokens, digest)
            stream.active_at = now
            self._stream_changed.notify_all()
        return stream

    def stage(self, stream: StagedStream, first_block: int, chunk: torch.Tensor) -> None:
        """Blocks [first_block, first_block + len) of a stream, copied out of the cache."""
        with self._stream_changed:
            if stream.failed or stream.gone:
                return
            stream.chunks.append((first_block, chunk))
            stream.active_at = time.monotonic()
            self._stream_changed.notify_all()

    def finish_stream(self, stream: StagedStream, final: dict[str, Any] | None) -> None:
        """The prompt is done (`final`: its RemotePrefill dict), or will never be (None)."""
        with self._stream_changed:
            if stream.failed or stream.gone:
                return
            if final is None:
                self._fail(stream)
            else:
                stream.final = msgspec.msgpack.encode(final)
                stream.ended_at = time.monotonic()
            self._stream_changed.notify_all()

    def _fail(self, stream: StagedStream) -> None:
        """End a stream (the lock held): its copies go, a pull under way gets STATUS_UNKNOWN,
        and one nobody makes is dropped now."""
        stream.failed = True
        stream.chunks.clear()
        stream.ended_at = time.monotonic()
        if not stream.pulled:
            self._drop(stream)

    def _drop(self, stream: StagedStream) -> None:
        """Out of the table (the lock held), its id remembered for a while."""
        if self._streams.get(stream.transfer_id) is stream:
            del self._streams[stream.transfer_id]
        stream.gone = True
        stream.chunks.clear()
        self._remember_ended(stream.transfer_id)

    def _remember_ended(self, transfer_id: str) -> None:
        """(The lock held.)"""
        self._ended_ids[transfer_id] = None
        self._ended_order.append((time.monotonic() + self.config.hold_seconds, transfer_id))

    def take_released(self) -> list[str]:
        """Requests this side is done with (sent, released by the peer, or expired)."""
        now = time.monotonic()
        ended_before = now - self.config.hold_seconds
        with self._lock:
            expired = [
                request_id
                for request_id, held in self._held.items()
                if not held.sending and held.expires_at <= now
            ]
            for request_id in expired:
                del self._held[request_id]
            # Finished prompts nobody pulled (a pulled stream is its sending thread's to end).
            stale = [
                stream
                for stream in self._streams.values()
                if not stream.pulled
                and stream.ended_at is not None
                and stream.ended_at <= ended_before
            ]
            for stream in stale:
                self._drop(stream)
            while self._ended_order and self._ended_order[0][0] <= now:
                self._ended_ids.pop(self._ended_order.popleft()[1], None)
        self.stats.num_expired += len(expired) + len(stale)
        for stream in stale:
            logger.warning("KV stream %s was not pulled in time: dropped", stream.transfer_id)
        for request_id in expired:
            logger.warning("KV of request %s was not pulled in time: freed", request_id)
        released = expired
        while True:
            try:
                released.append(self._released.get_nowait())
            except queue.Empty:
                return released

    @property
    def num_held_blocks(self) -> int:
        """Blocks held for pulls, and blocks staged for streams and not sent yet."""
        with self._lock:
            held = sum(len(held.block_ids) for held in self._held.values())
            return held + sum(
                chunk.shape[2] for stream in self._streams.values() for _, chunk in stream.chunks
            )

    # -- transfer threads -------------------------------------------------------------------

    def _release(self, request_ids: list[str], transfer_ids: Sequence[str] = ()) -> None:
        with self._stream_changed:
            found = [i for i in request_ids if self._held.pop(i, None) is not None]
            for transfer_id in transfer_ids:
                stream = self._streams.get(transfer_id)
                if stream is not None:
                    self._fail(stream)
                else:  # not opened yet: its prefill leg, if it comes, is not staged
                    self._remember_ended(transfer_id)
            self._stream_changed.notify_all()
        for request_id in found:
            self._released.put(request_id)
        if found:
            self.notify()

    def _serve_control(self) -> None:
        decoder = msgspec.msgpack.Decoder(ControlMessage)
        encoder = msgspec.msgpack.Encoder()
        peers: dict[str, _Pair] = {}
        while True:
            identity, frame = self._control.recv_multipart()
            try:
                message = decoder.decode(frame)
            except msgspec.DecodeError as error:
                logger.error("dropped an undecodable KV control message: %s", error)
                continue
            if isinstance(message, Hello):
                reply = self._welcome(message, peers)
                self._control.send_multipart([identity, encoder.encode(reply)])
            elif isinstance(message, Pull | StreamPull):
                pair = peers.get(message.peer_id)
                if pair is None:  # its pair group failed: it will say Hello again
                    logger.warning("a pull from unpaired peer %s: ignored", message.peer_id)
                elif isinstance(message, Pull):
                    pair.pulls.put(message)
                else:
                    self._start_stream(message, pair)
            elif isinstance(message, Release):
                self._release(message.request_ids, message.transfer_ids)

    def _welcome(self, hello: Hello, peers: dict[str, _Pair]) -> Welcome:
        if hello.layout != self.layout:
            return Welcome(
                error=f"KV cache layouts differ: prefill {self.layout}, decode {hello.layout} "
                "(serve the same model, block size, dtype and kv cache dtype on both)"
            )
        pair_name = f"{hello.peer_id}/{next(self._pair_ids)}"
        pair = _Pair()
        replaced = peers.get(hello.peer_id)
        if replaced is not None:  # a new Hello from the peer replaces its old pair: that
            replaced.pulls.put(None)  # pair's thread ends, and its group goes with it
        peers[hello.peer_id] = pair
        threading.Thread(
            target=self._serve_peer, args=(pair_name, pair, peers, hello.peer_id),
            name=f"tandem-kv-send-{pair_name}", daemon=True,
        ).start()  # fmt: skip
        return Welcome(pair_name, self.config.port + 1)

    def _serve_peer(
        self, pair_name: str, pair: _Pair, peers: dict[str, _Pair], peer_id: str
    ) -> None:
        try:
            group = pair_group(
                self.config.host, self.config.port + 1, pair_name, 0, self.config.host,
                self.config.timeout, self._store,
            )  # fmt: skip
            pair.group = group
        except Exception as error:
            logger.error("KV pair group %s could not form: %s", pair_name, error)
            return
        finally:
            pair.formed.set()
        logger.info("KV pair group %s formed", pair_name)
        while (pull := pair.pulls.get()) is not None:
            try:
                self._send(group, pull)
            except Exception as error:  # the peer died or timed out: it prefills locally
                logger.error("KV transfer to %s failed: %s", pair_name, error)
                self._release([pull.request_id])
                if peers.get(peer_id) is pair:
                    del peers[peer_id]
                return

    def _start_stream(self, pull: StreamPull, pair: _Pair) -> None:
        now = time.monotonic()
        with self._lock:
            stream = self._streams.get(pull.transfer_id)
            if stream is None and pull.transfer_id not in self._ended_ids:
                # The pull came before the prefill request: it waits for it.
                stream = self._streams[pull.transfer_id] = StagedStream(pull.transfer_id, now)
            if stream is not None and stream.pulled:
                stream = None  # a second pull of one transfer: refused, the first goes on
            elif stream is not None:
                stream.pulled = True
        threading.Thread(
            target=self._send_stream, args=(pair, pull, stream),
            name=f"tandem-kv-stream-{pull.transfer_id}", daemon=True,
        ).start()  # fmt: skip

    def _send_stream(self, pair: _Pair, pull: StreamPull, stream: StagedStream | None) -> None:
        """Send a stream's chunks as they are staged, then its RemotePrefill dict (None: refuse
        the pull). While it waits, a keep-alive header well within either side's timeout, so
        the decode side's receive does not time out on a prompt that is queued or computing;
        a prompt that has not come within the timeout (its prefill leg failed), or that stays
        silent for --kv-hold-seconds (stalled), ends it, as does an abort."""
        pair.formed.wait(self.config.timeout)
        group = pair.group
        try:
            if group is None:
                raise RuntimeError("the pair group did not form")
            if stream is None:
                send_stream_header(group, pull.tag, STATUS_UNKNOWN)
                return
            self._stream_to(group, pull, stream)
        except Exception as error:  # the peer died: it prefills locally
            logger.error("KV stream %s failed: %s", pull.transfer_id, error)
        finally:
            if stream is not None:
                with self._lock:
                    self._drop(stream)

    def _stream_to(self, group: ProcessGroupGloo, pull: StreamPull, stream: StagedStream) -> None:
        keep_alive = min(self.config.timeout, pull.timeout) / 3
        made_at = time.monotonic()
        num_blocks = 0
        while True:
            with self._stream_changed:
                self._stream_changed.wait_for(
                    lambda: stream.chunks or stream.final is not None or stream.failed,
                    keep_alive,
                )
                chunks = list(stream.chunks)
                stream.chunks.clear()
                final, failed, prompt = stream.final, stream.failed, stream.prompt
                silent_for = time.monotonic() - stream.active_at
            if prompt is None and time.monotonic() - made_at > self.config.timeout:
                failed = True  # its prefill leg never came
            elif final is None and silent_for > self.config.hold_seconds:
                failed = True  # queued or stalled too long: the decode side prefills
            if prompt is not None and prompt != (pull.num_prompt_tokens, pull.prompt_digest):
                send_stream_header(group, pull.tag, STATUS_MISMATCH)
                return
            if failed:
                send_stream_header(group, pull.tag, STATUS_UNKNOWN)
                return
            for first, chunk in chunks:
                skip = max(0, pull.first_block - first)  # the decode side's prefix-cache hits
                count = chunk.shape[2] - skip
                if count <= 0:
                    continue
                send_stream_header(group, pull.tag, STATUS_OK, first + skip, count)
                group.send([chunk[:, :, skip:].contiguous()], 1, pull.tag).wait()
                num_blocks += count
            if final is not None:
                send_stream_header(group, pull.tag, STATUS_DONE, size=len(final))
                payload = torch.frombuffer(bytearray(final), dtype=torch.uint8)
                group.send([payload], 1, pull.tag).wait()
                self._count_sent(num_blocks)
                return
            if not chunks:
                send_stream_header(group, pull.tag, STATUS_WAIT)

    def _count_sent(self, num_blocks: int) -> None:
        with self._lock:  # streams to several peers finish on their own threads
            self.stats.num_sent += 1
            self.stats.num_sent_blocks += num_blocks
            self.stats.sent_bytes += num_blocks * block_bytes(self.kv_caches)

    def _send(self, group: ProcessGroupGloo, pull: Pull) -> None:
        with self._lock:
            held = self._held.get(pull.request_id)
            if held is not None:
                held.sending = True
        end = pull.first_block + pull.num_blocks
        if held is None or pull.first_block < 0 or end > len(held.block_ids):
            header = torch.tensor([STATUS_UNKNOWN, 0], dtype=torch.int64)
            group.send([header], 1, TAG).wait()
            if held is not None:
                self._release([pull.request_id])
            return
        group.send([torch.tensor([STATUS_OK, pull.num_blocks], dtype=torch.int64)], 1, TAG).wait()
        block_ids = torch.tensor(held.block_ids[pull.first_block : end], dtype=torch.int64)
        pending = []  # two chunks in flight: gather the next while one is on the wire
        for start, stop in chunk_ranges(pull.num_blocks, self.blocks_per_chunk):
            chunk = gather_blocks(self.kv_caches, block_ids[start:stop])
            pending.append((group.send([chunk], 1, TAG), chunk))
            if len(pending) == 2:
                pending.pop(0)[0].wait()
        for work, _ in pending:
            work.wait()
        self._count_sent(pull.num_blocks)
        self._release([pull.request_id])
