"""What the two ends of a KV transfer share: the control messages (ZeroMQ, msgpack) and the
data path (a two-rank torch.distributed gloo group per prefill/decode pair, built without a
global process group so that any number of instances can pair up while they run).

Data on a pair group, per pulled request: a header [status, number of blocks], then chunks of
blocks, each one tensor [layers, 2, blocks, block_size, kv heads, head dim] (keys and values of
every layer of those blocks), sent in order on tag 0. A streamed pull has a tag of its own
(streams to one peer interleave): headers [status, first block, number of blocks, bytes], each
followed by its chunk, or, last, by the msgpack of the RemotePrefill dict (status DONE)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import msgspec
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

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
    computed, then its RemotePrefill dict, on our pair group with tag `tag`."""

    peer_id: str
    transfer_id: str
    tag: int
    first_block: int
    num_prompt_tokens: int
    prompt_digest: str


class Release(msgspec.Struct, tag="release"):
    """Decode -> prefill: these requests' blocks (or transfers' streams) will not be pulled, or
    no longer (they ended at their first token, or were aborted): free them now."""

    request_ids: list[str]
    transfer_ids: list[str] = []


ControlMessage = Hello | Welcome | Pull | StreamPull | Release


def cache_layout(kv_caches: Sequence[torch.Tensor]) -> list[str | int]:
    """What must match for one instance's blocks to mean the same in another's cache."""
    _, _, block_size, num_kv_heads, head_dim = kv_caches[0].shape
    dtype = str(kv_caches[0].dtype).removeprefix("torch.")
    return [len(kv_caches), block_size, num_kv_heads, head_dim, dtype]


def block_bytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block across every layer, keys and values."""
    cache = kv_caches[0]
    return len(kv_caches) * cache[:, 0].numel() * cache.element_size()


def blocks_per_chunk(kv_caches: Sequence[torch.Tensor], chunk_bytes: int) -> int:
    """Blocks in one chunk of about `chunk_bytes` (at least one)."""
    return max(1, chunk_bytes // block_bytes(kv_caches))


def chunk_ranges(num_blocks: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
    return [
        (start, min(start + blocks_per_chunk, num_blocks))
        for start in range(0, num_blocks, blocks_per_chunk)
    ]


def pair_group(
    store_host: str,
    store_port: int,
    pair_name: str,
    rank: int,
    local_host: str,
    timeout: float,
    store: TCPStore | None = None,
) -> ProcessGroupGloo:
    """Join a two-rank gloo group (rank 0: the prefill side, which hosts `store`). Blocks until
    both ranks have joined or `timeout` passes."""
    delta = datetime.timedelta(seconds=timeout)
    if store is None:
        store = TCPStore(store_host, store_port, is_master=False, timeout=delta)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
    options._timeout = delta
    return ProcessGroupGloo(PrefixStore(f"tandem-kv/{pair_name}", store), rank, 2, options)


def host_store(host: str, port: int, timeout: float) -> TCPStore:
    """The prefill side's rendezvous store, shared by all its pair groups."""
    return TCPStore(
        host, port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip


def gather_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """The blocks' keys and values of every layer in one host tensor, ready to send."""
    cache = kv_caches[0]
    shape = (len(kv_caches), 2, len(block_ids), *cache.shape[2:])
    out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    ids = block_ids.to(cache.device)
    for layer, layer_cache in enumerate(kv_caches):
        torch.index_select(layer_cache, 1, ids, out=out[layer])
    return out.cpu()


def scatter_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, chunk: torch.Tensor
) -> None:
    """Write a received chunk into the cache's blocks `block_ids`."""
    device = kv_caches[0].device
    ids = block_ids.to(device)
    chunk = chunk.to(device, non_blocking=True)
    for layer, layer_cache in enumerate(kv_caches):
        layer_cache.index_copy_(1, ids, chunk[layer])


def empty_chunk(kv_caches: Sequence[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """A host buffer that receives `num_blocks` blocks (pinned where a GPU will read it)."""
    cache = kv_caches[0]
    shape = (len(kv_caches), 2, num_blocks, *cache.shape[2:])
    return torch.empty(shape, dtype=cache.dtype, pin_memory=cache.is_cuda)
