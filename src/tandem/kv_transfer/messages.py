"""The control messages of a KV transfer (ZeroMQ, msgpack) and the statuses of its data
headers. Torch-free: the router sends a Release too."""

from __future__ import annotations

import msgspec

STATUS_OK = 0
STATUS_UNKNOWN = 1  # not held (never, expired, or already sent): the decode side prefills
STATUS_WAIT = 2  # a stream's keep-alive while its prompt waits or computes
STATUS_DONE = 3  # a stream's end: the RemotePrefill dict follows
STATUS_MISMATCH = 4  # a stream whose prompt is not the decode request's
TAG = 0


class Hello(msgspec.Struct, tag="hello"):
    """Decode -> prefill: pair with me. `layout`: the decode side's KV cache layout; the
    prefill side refuses a different one (another model, block size or dtype)."""

    peer_id: str
    layout: list[str | int]


class Welcome(msgspec.Struct, tag="welcome"):
    """Prefill -> decode: join pair group `pair_name` through the store at `store_port`."""

    pair_name: str = ""
    store_port: int = 0
    error: str | None = None


class Pull(msgspec.Struct, tag="pull"):
    """Decode -> prefill: send blocks [first_block, first_block + num_blocks) of a held
    request on our pair group."""

    peer_id: str
    request_id: str
    first_block: int
    num_blocks: int


class StreamPull(msgspec.Struct, tag="stream-pull"):
    """Decode -> prefill: send transfer `transfer_id`'s blocks from `first_block` on as they are
    computed, then its RemotePrefill dict, on our pair group with tag `tag`. `timeout`: how
    long our receive waits (keep-alives must come sooner)."""

    peer_id: str
    transfer_id: str
    tag: int
    first_block: int
    num_prompt_tokens: int
    prompt_digest: str
    timeout: float


class Release(msgspec.Struct, tag="release"):
    """Decode (or the router, for a prefill leg that failed) -> prefill: these requests'
    blocks (or transfers' streams) will not be pulled, or no longer (they ended at their first
    token, or were aborted): free them now."""

    request_ids: list[str]
    transfer_ids: list[str] = []


ControlMessage = Hello | Welcome | Pull | StreamPull | Release
