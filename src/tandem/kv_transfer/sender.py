"""The prefill side: keeps finished prompts' blocks and sends them to the decode instances that
pull them. A control thread answers ZeroMQ messages; each decode peer gets a thread that owns
its pair group and sends one request's blocks after another. Blocks are freed only by the
engine core's thread (the block pool is not thread-safe): this side reports which requests it
is done with, and the core releases them."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch
import zmq

from tandem.kv_transfer.channel import (
    STATUS_OK,
    STATUS_UNKNOWN,
    TAG,
    ControlMessage,
    Hello,
    Pull,
    Release,
    Welcome,
    block_bytes,
    blocks_per_chunk,
    cache_layout,
    chunk_ranges,
    gather_blocks,
    host_store,
    pair_group,
)
from tandem.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    block_ids: list[int]
    expires_at: float
    sending: bool = False


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
        self._lock = threading.Lock()
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

    def take_released(self) -> list[str]:
        """Requests this side is done with (sent, released by the peer, or expired)."""
        now = time.monotonic()
        with self._lock:
            expired = [
                request_id
                for request_id, held in self._held.items()
                if not held.sending and held.expires_at <= now
            ]
            for request_id in expired:
                del self._held[request_id]
        self.stats.num_expired += len(expired)
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
        with self._lock:
            return sum(len(held.block_ids) for held in self._held.values())

    # -- transfer threads -------------------------------------------------------------------

    def _release(self, request_ids: list[str]) -> None:
        with self._lock:
            found = [i for i in request_ids if self._held.pop(i, None) is not None]
        for request_id in found:
            self._released.put(request_id)
        if found:
            self.notify()

    def _serve_control(self) -> None:
        decoder = msgspec.msgpack.Decoder(ControlMessage)
        encoder = msgspec.msgpack.Encoder()
        peers: dict[str, queue.SimpleQueue[Pull]] = {}
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
            elif isinstance(message, Pull):
                pulls = peers.get(message.peer_id)
                if pulls is None:  # its pair group failed: it will say Hello again
                    logger.warning("a pull from unpaired peer %s: ignored", message.peer_id)
                else:
                    pulls.put(message)
            elif isinstance(message, Release):
                self._release(message.request_ids)

    def _welcome(self, hello: Hello, peers: dict[str, queue.SimpleQueue[Pull]]) -> Welcome:
        if hello.layout != self.layout:
            return Welcome(
                error=f"KV cache layouts differ: prefill {self.layout}, decode {hello.layout} "
                "(serve the same model, block size and dtype on both)"
            )
        pair_name = f"{hello.peer_id}/{next(self._pair_ids)}"
        pulls: queue.SimpleQueue[Pull] = queue.SimpleQueue()
        peers[hello.peer_id] = pulls  # a new Hello from the peer replaces its old pair
        threading.Thread(
            target=self._serve_peer, args=(pair_name, pulls, peers, hello.peer_id),
            name=f"tandem-kv-send-{pair_name}", daemon=True,
        ).start()  # fmt: skip
        return Welcome(pair_name, self.config.port + 1)

    def _serve_peer(
        self,
        pair_name: str,
        pulls: queue.SimpleQueue[Pull],
        peers: dict[str, queue.SimpleQueue[Pull]],
        peer_id: str,
    ) -> None:
        try:
            group = pair_group(
                self.config.host, self.config.port + 1, pair_name, 0, self.config.host,
                self.config.timeout, self._store,
            )  # fmt: skip
        except Exception as error:
            logger.error("KV pair group %s could not form: %s", pair_name, error)
            return
        logger.info("KV pair group %s formed", pair_name)
        while True:
            pull = pulls.get()
            try:
                self._send(group, pull)
            except Exception as error:  # the peer died or timed out: it prefills locally
                logger.error("KV transfer to %s failed: %s", pair_name, error)
                self._release([pull.request_id])
                if peers.get(peer_id) is pulls:
                    del peers[peer_id]
                return

    def _send(self, group, pull: Pull) -> None:
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
        self.stats.num_sent += 1
        self.stats.num_sent_blocks += pull.num_blocks
        self.stats.sent_bytes += pull.num_blocks * block_bytes(self.kv_caches)
        self._release([pull.request_id])
