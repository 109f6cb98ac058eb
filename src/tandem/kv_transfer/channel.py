"""The data path of a KV transfer: a two-rank torch.distributed gloo group per prefill/decode
pair, built without a global process group so that any number of instances can pair up while
they run (the control messages are in messages.py).

Data on a pair group, per pulled request: a header [status, number of blocks], then chunks of
blocks, each one tensor [layers, 2, blocks, block_size, kv heads, head dim] (keys and values of
every layer of those blocks), sent in order on tag 0. A streamed pull has a tag of its own
(streams to one peer interleave): headers [status, first block, number of blocks, payload
bytes], each OK one followed by its chunk, and the last (DONE) by the msgpack of the
RemotePrefill dict."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore


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


def send_stream_header(
    group: ProcessGroupGloo, tag: int, status: int, first: int = 0, count: int = 0, size: int = 0
) -> None:
    """A stream's header to the decode side (rank 1): [status, first block, blocks, bytes]."""
    header = torch.tensor([status, first, count, size], dtype=torch.int64)
    group.send([header], 1, tag).wait()


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
