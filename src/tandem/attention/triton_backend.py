"""Paged attention in Triton: the GPU path, same interface as torch_backend.paged_attention.

Two kernels and a merge. `_store_kv` writes the step's new keys and values into their cache
slots. `_paged_attention` computes, for every request of a mixed batch (prefill chunks,
decodes, draft verification alike), causal attention of its query tokens over its whole
context, reading the cache through the block table in place (no gathered copy). One program
takes up to BLOCK_Q query tokens of one request and one kv head, with that kv head's query
heads packed as rows (GQA: each key/value block is read once per kv head, not once per query
head), walks the context in tiles of 32 or 64 keys, each key found in its cache block
through the block table (any block size), with an online softmax in fp32, and masks
each row at its own position (the causal offset is the tokens already cached). Decode-only
steps whose programs are too few to fill the device split each context into ranges
(split-KV): each range's unnormalized output, running max and sum go to scratch, and
`_merge_splits` combines them.

Which program takes which queries is planned on the host from the metadata's host arrays,
once per step (every layer reuses it). Verified against the torch backend on CPU under
TRITON_INTERPRET=1 (tests/unit/test_triton_attention.py) and at full size on a GPU
(benchmarks/gpu_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from tandem.attention.metadata import AttentionMetadata, copy_to_device

# Programs a decode-only step should launch to keep a large GPU busy (an H200 has 132 SMs);
# fewer, and contexts are split into ranges of at least MIN_SPLIT_KEYS keys.
TARGET_PROGRAMS = 512
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64


@triton.jit
def _store_kv(
    key,
    value,
    key_cache,
    value_cache,
    slots,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token)
    heads = tl.arange(0, NUM_KV_HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    # The slot test broadcast over the tile: the interpreter rejects a scalar in a mask.
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (dims * 0 + slot >= 0)
    cache_offset = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    k = tl.load(key + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    tl.store(key_cache + cache_offset, k, mask=mask)
    v = tl.load(value + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    tl.store(value_cache + cache_offset, v, mask=mask)


@triton.jit
def _paged_attention(
    query,
    output,
    key_cache,
    value_cache,
    block_table,
    seq_lens,
    query_start_loc,
    program_request,
    program_query_start,
    partial_out,
    partial_max,
    partial_sum,
    scale,
    query_stride_token,
    query_stride_head,
    output_stride_token,
    output_stride_head,
    block_table_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    IEEE: tl.constexpr,
):
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    request = tl.load(program_request + program).to(tl.int64)
    query_first = tl.load(program_query_start + program)
    token_start = tl.load(query_start_loc + request)
    query_len = tl.load(query_start_loc + request + 1) - token_start
    context_len = tl.load(seq_lens + request)

    # Rows: BLOCK_Q query tokens x GROUP_P query heads of this kv head.
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    query_index = query_first + rows // GROUP_P
    head_in_group = rows % GROUP_P
    row_valid = (query_index < query_len) & (head_in_group < QUERIES_PER_KV)
    token = token_start + query_index
    head = kv_head * QUERIES_PER_KV + head_in_group
    dims = tl.arange(0, HEAD_DIM_P)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query + token[:, None] * query_stride_token + head[:, None] * query_stride_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # fmt: skip
    position = context_len - query_len + query_index  # each row's own place in the context

    # Keys up to the last query of this program, in tiles of TILE keys (whatever the cache's
    # block size: each key finds its block through the table); this split's share of the
    # tiles (at least MIN_SPLIT_TILES, so a short context leaves the later splits empty).
    # Sized here, from the program's own context, so a captured graph serves any length.
    last_query = tl.minimum(query_first + BLOCK_Q, query_len) - 1
    num_keys = context_len - query_len + last_query + 1
    num_tiles = tl.cdiv(num_keys, TILE)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), MIN_SPLIT_TILES)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(num_tiles, tile_lo + tiles_per_split)

    qk_scale = scale * 1.4426950408889634  # exp2 below: scores in log2 units
    running_max = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    offsets = tl.arange(0, TILE)
    slot_stride = NUM_KV_HEADS * HEAD_DIM
    for i in range(tile_lo, tile_hi):
        key_position = i * TILE + offsets
        key_valid = key_position < num_keys
        block = tl.load(block_table + request * block_table_stride + key_position // BLOCK_SIZE,
                        mask=key_valid, other=0).to(tl.int64)  # fmt: skip
        base = (block * BLOCK_SIZE + key_position % BLOCK_SIZE) * slot_stride + kv_head * HEAD_DIM
        keys = tl.load(key_cache + base[None, :] + dims[:, None],
                       mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # fmt: skip
        if IEEE:  # noqa: SIM108 (a statement: the branch not taken is never compiled)
            scores = tl.dot(q, keys, input_precision="ieee")
        else:
            scores = tl.dot(q, keys)
        allowed = key_position[None, :] <= position[:, None]
        scores = tl.where(allowed, scores * qk_scale, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        correction = tl.exp2(running_max - safe_max)
        running_sum = running_sum * correction + tl.sum(probs, 1)
        values = tl.load(value_cache + base[:, None] + dims[None, :],
                         mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # fmt: skip
        if IEEE:
            update = tl.dot(probs.to(values.dtype), values, input_precision="ieee")
        else:
            update = tl.dot(probs.to(values.dtype), values)
        acc = acc * correction[:, None] + update
        running_max = new_max

    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(
            output + token[:, None] * output_stride_token + head[:, None] * output_stride_head
            + dims[None, :],
            out.to(output.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )  # fmt: skip
    else:
        # Scratch indexed [token, head, split]; the max is kept in log2 units.
        partial = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_max + partial, running_max, mask=row_valid)
        tl.store(partial_sum + partial, running_sum, mask=row_valid)
        tl.store(partial_out + partial[:, None] * HEAD_DIM_P + dims[None, :], acc,
                 mask=row_valid[:, None])  # fmt: skip


@triton.jit
def _merge_splits(
    output,
    partial_out,
    partial_max,
    partial_sum,
    output_stride_token,
    output_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    valid = splits < NUM_SPLITS
    partial = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    maxes = tl.load(partial_max + partial, mask=valid, other=float("-inf"))
    sums = tl.load(partial_sum + partial, mask=valid, other=0.0)
    overall = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - overall))
    dims = tl.arange(0, HEAD_DIM_P)
    outs = tl.load(partial_out + partial[:, None] * HEAD_DIM_P + dims[None, :],
                   mask=valid[:, None], other=0.0)  # fmt: skip
    total = tl.sum(sums * weights, 0)
    out = tl.sum(outs * weights[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(output + token * output_stride_token + head * output_stride_head + dims,
             out.to(output.dtype.element_ty), mask=dims < HEAD_DIM)  # fmt: skip


@dataclass
class _Plan:
    """Which program takes which queries, derived once per step and shared by every layer."""

    program_request: torch.Tensor  # [P] the request of each program
    program_query_start: torch.Tensor  # [P] its first query token within the request
    block_q: int  # query tokens per program
    tile: int  # keys per iteration
    num_splits: int  # > 1: split-KV (decode-only steps)


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def _block_q_and_tile(max_query_len: int, queries_per_kv: int) -> tuple[int, int]:
    """Query tokens per program and keys per iteration. Rows (query tokens x packed heads): 16
    is tl.dot's least, enough for decodes and draft verification, with tiles of 32 keys;
    longer queries get 64 rows, so that each key read serves more of them, and tiles of 64."""
    group_p = _next_power_of_2(queries_per_kv)
    if max_query_len * group_p <= 16:
        return max(16, group_p) // group_p, 32
    return max(64, group_p) // group_p, 64


def _num_stages(dtype: torch.dtype, tile: int, head_dim_p: int) -> int:
    """Software-pipeline stages of the attention kernel: triton's default 3, but one for fp32
    tiles of 64 keys of 128 (the reference dtype, never a speed path): 3 stages of their keys
    and values (64 KB a stage) would pass the 227 KB of shared memory a Hopper block has."""
    return 1 if dtype == torch.float32 and tile * head_dim_p >= 64 * 128 else 3


def _decode_splits(num_programs: int) -> int:
    return min(-(-TARGET_PROGRAMS // max(num_programs, 1)), MAX_SPLITS)


def plan_programs(md: AttentionMetadata, queries_per_kv: int, num_kv_heads: int) -> _Plan:
    """Cut every request's query tokens into programs of `block_q`; split the contexts of a
    decode-only step whose programs would leave the device idle."""
    query_lens = np.diff(md.query_start_loc_cpu)
    max_query_len = int(query_lens.max(initial=1))
    block_q, tile = _block_q_and_tile(max_query_len, queries_per_kv)
    num_programs_of = -(-query_lens // block_q)
    program_request = np.repeat(np.arange(len(query_lens)), num_programs_of)
    first = np.cumsum(num_programs_of) - num_programs_of
    program_query_start = (np.arange(len(program_request)) - first[program_request]) * block_q
    num_splits = 1
    num_programs = len(program_request) * num_kv_heads
    if max_query_len <= block_q and num_programs < TARGET_PROGRAMS:
        max_keys = int(md.seq_lens_cpu.max(initial=1))
        num_splits = min(_decode_splits(num_programs), -(-max_keys // MIN_SPLIT_KEYS))
    requests, query_starts = copy_to_device(
        [program_request, program_query_start], md.slot_mapping.device
    )
    return _Plan(
        program_request=requests,
        program_query_start=query_starts,
        block_q=block_q,
        tile=tile,
        num_splits=num_splits,
    )


def decode_plan(
    num_requests: int, queries_per_kv: int, num_kv_heads: int, device: torch.device
) -> _Plan:
    """The plan of a decode-only step of `num_requests` (one program each), fixed whatever
    the contexts, for a captured graph: split as if every context were long."""
    block_q, tile = _block_q_and_tile(1, queries_per_kv)
    return _Plan(
        program_request=torch.arange(num_requests, device=device),
        program_query_start=torch.zeros(num_requests, dtype=torch.int64, device=device),
        block_q=block_q,
        tile=tile,
        num_splits=_decode_splits(num_requests * num_kv_heads),
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the step's new keys/values [T, KVH, D] into their cache slots (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _store_kv[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_P=_next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_P=_next_power_of_2(head_dim),
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """torch_backend.paged_attention on the kernels above (kv_cache contiguous)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    if metadata.backend_plan is None:
        metadata.backend_plan = plan_programs(metadata, queries_per_kv, num_kv_heads)
    plan: _Plan = metadata.backend_plan
    store_kv(key, value, kv_cache, metadata.slot_mapping)
    if query.stride(2) != 1:
        query = query.contiguous()
    output = torch.empty_like(query)
    head_dim_p = _next_power_of_2(head_dim)
    splits = plan.num_splits
    if splits > 1:
        partial_out = torch.empty(
            (num_tokens, num_heads, splits, head_dim_p), dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32,
                                  device=query.device)  # fmt: skip
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = output  # unused by the kernel
    grid = (len(plan.program_request), num_kv_heads, splits)
    _paged_attention[grid](
        query, output, kv_cache[0], kv_cache[1], metadata.block_table, metadata.seq_lens,
        metadata.query_start_loc, plan.program_request, plan.program_query_start,
        partial_out, partial_max, partial_sum, scale,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        metadata.block_table.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, QUERIES_PER_KV=queries_per_kv,
        GROUP_P=_next_power_of_2(queries_per_kv), BLOCK_Q=plan.block_q, HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=metadata.block_size, TILE=plan.tile,
        NUM_SPLITS=splits, MIN_SPLIT_TILES=MIN_SPLIT_KEYS // plan.tile,
        IEEE=query.dtype == torch.float32,
        # 64-row programs spill registers with 4 warps at head size 128 (ptxas, sm_90).
        num_warps=8 if plan.block_q * _next_power_of_2(queries_per_kv) >= 64 else 4,
        num_stages=_num_stages(query.dtype, plan.tile, head_dim_p),
    )  # fmt: skip
    if splits > 1:
        _merge_splits[(num_tokens, num_heads)](
            output, partial_out, partial_max, partial_sum, output.stride(0), output.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=splits, SPLITS_P=_next_power_of_2(splits),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        )  # fmt: skip
    return output
