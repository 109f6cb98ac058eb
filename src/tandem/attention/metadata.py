"""Per-step inputs of one flattened varlen batch, built with vectorized numpy.

The model runner sets the step's `AttentionMetadata` in a global context; attention layers read
it, so model code never threads metadata through every call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import numpy as np
import torch

from tandem.attention.block_tables import BlockTables


class RequestSlice(Protocol):
    """What the batch builder needs of one scheduled request (the scheduler's output has it)."""

    token_ids: Sequence[int]  # every known token of the request: prompt + generated
    num_computed_tokens: int  # tokens whose K/V are already in the cache
    num_new_tokens: int  # tokens to compute this step
    # The request's block table. A runner keeps tables between steps (BlockTables): a list
    # given again must only have grown since, or be a new list object.
    block_ids: Sequence[int]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token; -1 = do not store
    query_start_loc: torch.Tensor  # [B+1] offsets of each request's tokens in the batch
    seq_lens: torch.Tensor  # [B] context length after this step (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] block ids, padded with 0
    # Host copies: the torch backend slices per request with them, without device syncs.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    num_computed_tokens_cpu: np.ndarray
    # Query tokens attended to in batched calls, each over its own context (the positions up
    # to its own): the tokens of every request with at most MAX_DECODE_QUERY new ones (a decode
    # token, the tokens verifying drafts, a short prompt chunk). Every other request is a
    # prefill chunk, attended to whole.
    decode_token_indices_cpu: np.ndarray  # [D] rows of the batch
    decode_token_requests_cpu: np.ndarray  # [D] the request of each
    decode_token_seq_lens_cpu: np.ndarray  # [D] context length at each: position + 1
    prefill_indices_cpu: np.ndarray  # requests
    block_size: int
    # Index tensors a backend derives once per step and every layer reuses.
    backend_plan: object | None = None


@dataclass
class PromptLogitsInputs:
    """Rows of the batch whose logits give prompt logprobs, request by request in batch order."""

    indices: torch.Tensor  # [R] rows of the hidden states
    target_ids: torch.Tensor  # [R] the token each row predicts: the one after its position
    num_rows: np.ndarray  # [B] how many of the R rows each request has


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to turn into logits, ascending
    prompt_logits: PromptLogitsInputs | None = None
    # Async scheduling: tokens whose ids a step still in flight is sampling (placeholders,
    # -1 in input_ids until the runner fills them in): their rows, and the request of each.
    placeholder_indices: torch.Tensor | None = None
    placeholder_requests_cpu: np.ndarray | None = None


# An empty index array, shared (read-only): a decode step's prefill requests and placeholders.
_NONE = np.zeros(0, dtype=np.int64)
_NONE.flags.writeable = False

# A request with at most this many query tokens (its decode token, the tokens verifying its
# drafts, a short prompt chunk) is attended to in the batched decode calls, each token over the
# positions up to its own (its keys are stored first): not worth a prefill call of its own, and
# a step of nothing else runs the CPU's fused decode step (worker/cpu_decode.py).
MAX_DECODE_QUERY = 16
# Decode steps of at most this many requests take _few_decode_arrays (plain Python).
FEW_DECODES = 32
# ... and their block tables, when they hold at most this many ids in all, are made there too
# (in the step's one array), not gathered from the runner's BlockTables.
FEW_TABLE_IDS = 1024


@dataclass
class _HostBatch:
    """A step's inputs as host arrays, before they go to the device."""

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    num_computed: np.ndarray
    req_of_token: np.ndarray
    decode_tokens: np.ndarray
    decode_token_requests: np.ndarray  # the request of each decode token
    decode_token_seq_lens: np.ndarray  # its context length: position + 1
    prefill_indices: np.ndarray
    prompt_logits: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def build_batch(
    requests: Sequence[RequestSlice],
    block_size: int,
    device: torch.device,
    sample_mask: Sequence[bool] | None = None,
    prompt_logits_ranges: Sequence[tuple[int, int]] | None = None,
    draft_token_ids: Sequence[Sequence[int]] | None = None,
    block_tables: BlockTables | None = None,
) -> BatchInputs:
    """Flatten the scheduled requests into one batch. `sample_mask` picks the requests whose
    last new token gets logits (default: all). `prompt_logits_ranges`: per request, the
    positions [start, end) among its new tokens that also get logits, for prompt logprobs
    ((0, 0): none); each must have a known next token. `draft_token_ids`: per request, guessed
    tokens after its known ones, the last of its new tokens; a sampled request gets logits at
    its last known token and at each draft, in order. `block_tables`: the caller's tables
    kept from its previous steps (a runner's), so only new block ids are copied; default: built
    from scratch."""
    tables = BlockTables() if block_tables is None else block_tables
    if (
        draft_token_ids is None
        and prompt_logits_ranges is None
        and all(r.num_new_tokens == 1 for r in requests)
    ):
        if len(requests) <= FEW_DECODES:
            host = _few_decode_arrays(requests, block_size, sample_mask, tables)
        else:
            host = _decode_arrays(requests, block_size, sample_mask, tables)
    else:
        host = _mixed_arrays(
            requests, block_size, sample_mask, prompt_logits_ranges, draft_token_ids, tables
        )
    return _to_device(host, block_size, device)


def _decode_arrays(
    requests: Sequence[RequestSlice],
    block_size: int,
    sample_mask: Sequence[bool] | None,
    block_tables: BlockTables,
) -> _HostBatch:
    """`_mixed_arrays` for a step of one new token per request (no drafts, no prompt
    logprobs): the decode steps that are most steps, in a third of the numpy calls, which at
    small batches are most of the cost of building a step."""
    num_reqs = len(requests)
    num_computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_reqs)
    try:
        input_ids = np.fromiter(
            (r.token_ids[c] for r, c in zip(requests, num_computed.tolist(), strict=True)),
            np.int64,
            num_reqs,
        )
    except IndexError:
        raise ValueError("a request has fewer known token ids than it asks to compute") from None
    seq_lens = num_computed + 1
    block_of_token = num_computed // block_size
    block_table = _block_table(requests, block_of_token, block_tables)
    # One array in several roles below (positions too is num_computed): batch inputs are
    # read-only once built.
    every_request = np.arange(num_reqs)
    slot_mapping = (
        block_table[every_request, block_of_token] * block_size + num_computed % block_size
    )
    logits_indices = every_request
    if sample_mask is not None:
        logits_indices = np.flatnonzero(_request_mask(sample_mask, num_reqs))
    return _HostBatch(
        input_ids=input_ids,
        positions=num_computed,
        logits_indices=logits_indices,
        slot_mapping=slot_mapping,
        query_start_loc=np.arange(num_reqs + 1),
        seq_lens=seq_lens,
        block_table=block_table,
        num_computed=num_computed,
        req_of_token=every_request,
        decode_tokens=every_request,
        decode_token_requests=every_request,
        decode_token_seq_lens=seq_lens,
        prefill_indices=_NONE,
    )


def _few_decode_arrays(
    requests: Sequence[RequestSlice],
    block_size: int,
    sample_mask: Sequence[bool] | None,
    block_tables: BlockTables,
) -> _HostBatch:
    """`_decode_arrays` for a few requests: their numbers in plain Python, one array made of
    them. numpy's cost per call is most of what the vectorized path costs a small step."""
    num_reqs = len(requests)
    positions, input_ids, slots, seq_lens, block_lists = [], [], [], [], []
    for request in requests:
        position = request.num_computed_tokens
        token_ids, block_ids = request.token_ids, request.block_ids
        if position >= len(token_ids):
            raise ValueError("a request has fewer known token ids than it asks to compute")
        block = position // block_size
        if block >= len(block_ids):
            if any(r.num_computed_tokens >= len(r.token_ids) for r in requests):
                # The vectorized paths look at every request's tokens first: the same error.
                raise ValueError("a request has fewer known token ids than it asks to compute")
            raise ValueError("a request's block table is too short for its context")
        positions.append(position)
        input_ids.append(token_ids[position])
        slots.append(block_ids[block] * block_size + position % block_size)
        seq_lens.append(position + 1)
        block_lists.append(block_ids)
    width = max(map(len, block_lists), default=1)  # each holds its position's block
    if num_reqs * width <= FEW_TABLE_IDS:
        # One array for the columns and the zero-padded table: after a forward every numpy
        # call runs with cold caches (the table's gather alone took ~40 us for one request).
        flat = [*positions, *input_ids, *slots, *seq_lens]
        for block_ids in block_lists:
            flat += block_ids
            flat += [0] * (width - len(block_ids))
        values = np.array(flat, dtype=np.int64)
        columns = values[: 4 * num_reqs].reshape(4, num_reqs)
        block_table = values[4 * num_reqs :].reshape(num_reqs, width)
    else:
        columns = np.array([positions, input_ids, slots, seq_lens], dtype=np.int64)
        block_table, _ = block_tables.gather(block_lists)
    every_request = np.arange(num_reqs)
    logits_indices = every_request
    if sample_mask is not None:
        logits_indices = np.flatnonzero(_request_mask(sample_mask, num_reqs))
    return _HostBatch(
        input_ids=columns[1],
        positions=columns[0],
        logits_indices=logits_indices,
        slot_mapping=columns[2],
        query_start_loc=np.arange(num_reqs + 1),
        seq_lens=columns[3],
        block_table=block_table,
        num_computed=columns[0],
        req_of_token=every_request,
        decode_tokens=every_request,
        decode_token_requests=every_request,
        decode_token_seq_lens=columns[3],
        prefill_indices=_NONE,
    )


def _mixed_arrays(
    requests: Sequence[RequestSlice],
    block_size: int,
    sample_mask: Sequence[bool] | None,
    prompt_logits_ranges: Sequence[tuple[int, int]] | None,
    draft_token_ids: Sequence[Sequence[int]] | None,
    block_tables: BlockTables,
) -> _HostBatch:
    num_reqs = len(requests)
    num_new = np.fromiter((r.num_new_tokens for r in requests), np.int64, num_reqs)
    num_computed = np.fromiter((r.num_computed_tokens for r in requests), np.int64, num_reqs)
    if draft_token_ids is None:
        num_drafts = np.zeros(num_reqs, dtype=np.int64)
    else:
        num_drafts = np.fromiter((len(d) for d in draft_token_ids), np.int64, num_reqs)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    req_of_token = np.repeat(np.arange(num_reqs), num_new)
    offset_in_req = np.arange(num_tokens) - query_start_loc[req_of_token]
    positions = num_computed[req_of_token] + offset_in_req
    seq_lens = num_computed + num_new

    starts, ends = num_computed.tolist(), seq_lens.tolist()
    if draft_token_ids is None:
        parts = [r.token_ids[c:e] for r, c, e in zip(requests, starts, ends, strict=True)]
    else:
        parts = [
            [*r.token_ids[c : e - len(d)], *d]
            for r, c, e, d in zip(requests, starts, ends, draft_token_ids, strict=True)
        ]
    num_ids = sum(map(len, parts))
    if num_ids != num_tokens:
        raise ValueError("a request has fewer known token ids than it asks to compute")
    input_ids = np.fromiter(chain.from_iterable(parts), np.int64, num_ids)

    block_table = _block_table(requests, (seq_lens - 1) // block_size, block_tables)
    slot_mapping = (
        block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    )

    ends = query_start_loc[1:] - 1
    sampled_drafts = num_drafts
    if sample_mask is not None:
        mask = _request_mask(sample_mask, num_reqs)
        ends, sampled_drafts = ends[mask], num_drafts[mask]
    logits_indices = ends
    if sampled_drafts.any():
        counts = sampled_drafts + 1
        first = np.repeat(ends - sampled_drafts, counts)
        logits_indices = (
            first + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        )
    is_decode = num_new <= MAX_DECODE_QUERY
    decode_tokens = np.flatnonzero(is_decode[req_of_token])
    prompt_logits = None
    if prompt_logits_ranges is not None:
        prompt_logits = _prompt_logits_rows(
            requests, prompt_logits_ranges, query_start_loc, num_computed, num_new
        )
    return _HostBatch(
        input_ids=input_ids,
        positions=positions,
        logits_indices=logits_indices,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        num_computed=num_computed,
        req_of_token=req_of_token,
        decode_tokens=decode_tokens,
        decode_token_requests=req_of_token[decode_tokens],
        decode_token_seq_lens=positions[decode_tokens] + 1,
        prefill_indices=np.flatnonzero(~is_decode),
        prompt_logits=prompt_logits,
    )


def _request_mask(sample_mask: Sequence[bool], num_reqs: int) -> np.ndarray:
    mask = np.asarray(sample_mask, dtype=bool)
    if mask.shape != (num_reqs,):
        raise ValueError(f"sample_mask needs one entry per request ({num_reqs}), got {mask.shape}")
    return mask


def _block_table(
    requests: Sequence[RequestSlice], last_block: np.ndarray, block_tables: BlockTables
) -> np.ndarray:
    """[requests, most blocks held] block ids, padded with 0; checks each holds its context,
    whose last token is in its block `last_block` (-1: no tokens)."""
    block_table, held_blocks = block_tables.gather([r.block_ids for r in requests])
    if (last_block >= held_blocks).any():
        raise ValueError("a request's block table is too short for its context")
    return block_table


def _to_device(host: _HostBatch, block_size: int, device: torch.device) -> BatchInputs:
    input_ids = host.input_ids
    placeholders = _NONE
    # Up to FEW_DECODES ids are scanned in Python: numpy's min costs more than such a list.
    if len(input_ids) > FEW_DECODES:
        smallest = input_ids.min()
    else:
        smallest = min(input_ids.tolist(), default=0)
    if smallest < 0:
        placeholders = np.flatnonzero(input_ids < 0)
    arrays = {
        "input_ids": host.input_ids, "positions": host.positions,
        "logits_indices": host.logits_indices, "slot_mapping": host.slot_mapping,
        "query_start_loc": host.query_start_loc, "seq_lens": host.seq_lens,
        "block_table": host.block_table,
    }  # fmt: skip
    if len(placeholders):
        arrays["placeholders"] = placeholders
    if host.prompt_logits is not None:
        arrays["prompt_rows"], arrays["prompt_target_ids"], _ = host.prompt_logits
    on_device = dict(zip(arrays, copy_to_device(list(arrays.values()), device), strict=True))
    decode_tokens = host.decode_tokens
    metadata = AttentionMetadata(
        slot_mapping=on_device["slot_mapping"],
        query_start_loc=on_device["query_start_loc"],
        seq_lens=on_device["seq_lens"],
        block_table=on_device["block_table"],
        query_start_loc_cpu=host.query_start_loc,
        seq_lens_cpu=host.seq_lens,
        num_computed_tokens_cpu=host.num_computed,
        decode_token_indices_cpu=decode_tokens,
        decode_token_requests_cpu=host.decode_token_requests,
        decode_token_seq_lens_cpu=host.decode_token_seq_lens,
        prefill_indices_cpu=host.prefill_indices,
        block_size=block_size,
    )
    prompt_logits = None
    if host.prompt_logits is not None:
        prompt_logits = PromptLogitsInputs(
            on_device["prompt_rows"], on_device["prompt_target_ids"], host.prompt_logits[2]
        )
    return BatchInputs(
        input_ids=on_device["input_ids"],
        positions=on_device["positions"],
        attn_metadata=metadata,
        logits_indices=on_device["logits_indices"],
        prompt_logits=prompt_logits,
        placeholder_indices=on_device.get("placeholders"),
        placeholder_requests_cpu=host.req_of_token[placeholders] if len(placeholders) else None,
    )


def copy_to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Integer host arrays as contiguous int64 tensors on `device` (the CPU's fused decode step
    reads them by pointer). On CPU the arrays themselves where they are so (no copy). On a GPU
    through one pinned buffer and one copy: a step's inputs are many small arrays, and a copy
    of each pays a fixed cost (from pageable memory, a wait as well); torch's
    caching host allocator keeps the buffer until the copy has run, so it does not block."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)) for array in arrays]
    return split_like(pack(arrays, pin=True).to(device, non_blocking=True), arrays)


def _padded_sizes(arrays: Sequence[np.ndarray]) -> list[int]:
    """Each array's room in the packed buffer: an even number of int64s, so every view starts
    16-byte aligned (Triton compiles a kernel anew for each alignment of its pointers)."""
    return [array.size + array.size % 2 for array in arrays]


def pack(arrays: Sequence[np.ndarray], pin: bool) -> torch.Tensor:
    """The arrays' values in one int64 host tensor (pinned if `pin`), each at an aligned
    offset."""
    sizes = _padded_sizes(arrays)
    host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=pin)
    flat = host.numpy()
    offset = 0
    for array, size in zip(arrays, sizes, strict=True):
        flat[offset : offset + array.size] = array.reshape(-1)
        offset += size
    return host


def split_like(flat: torch.Tensor, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """`pack`'s tensor cut back into views shaped like `arrays`."""
    parts = flat.split(_padded_sizes(arrays))
    return [part[: array.size].view(array.shape) for part, array in zip(parts, arrays, strict=True)]


def _prompt_logits_rows(
    requests: Sequence[RequestSlice],
    ranges: Sequence[tuple[int, int]],
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    num_new: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch rows of the positions in `ranges`, their target (next) token ids, rows per request."""
    num_reqs = len(requests)
    if len(ranges) != num_reqs:
        raise ValueError(f"prompt_logits_ranges needs one range per request, got {len(ranges)}")
    bounds = np.array(ranges, dtype=np.int64).reshape(num_reqs, 2)
    starts, ends = bounds[:, 0], bounds[:, 1]
    num_rows = np.maximum(ends - starts, 0)
    wanted = num_rows > 0
    if np.any(wanted & ((starts < num_computed) | (ends > num_computed + num_new))):
        raise ValueError("a prompt-logits range lies outside the request's new tokens")
    owner = np.repeat(np.arange(num_reqs), num_rows)
    first_of_owner = np.cumsum(num_rows) - num_rows
    offsets = np.arange(int(num_rows.sum())) - first_of_owner[owner]
    rows = (query_start_loc[:-1] + starts - num_computed)[owner] + offsets
    target_ids = np.concatenate(
        [
            np.asarray(r.token_ids[start + 1 : end + 1], dtype=np.int64)
            for r, start, end in zip(requests, starts.tolist(), ends.tolist(), strict=True)
            if end > start
        ]
        or [np.zeros(0, dtype=np.int64)]
    )
    if len(target_ids) != len(rows):
        raise ValueError("a prompt-logits position has no next token to score")
    return rows, target_ids, num_rows


_current: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention called outside a forward_context (no batch metadata set)")
    return _current
