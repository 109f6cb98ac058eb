"""Reference paged attention in plain torch: the CPU path and the oracle for other backends.

Decode tokens (the tokens of a request with at most 16 new ones: its one query token, the
tokens verifying its drafts, a short prompt chunk) are attended to together in batched calls,
each over its own context gathered through its request's block table; prefill chunks (few per
step) go one request at a time through SDPA, with a causal mask offset by the tokens already in
the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata


@dataclass
class PrefillSlice:
    query_start: int
    query_end: int
    # None when the chunk is the whole context so far: attend to the fresh k/v, plain causal.
    context_block_ids: torch.Tensor | None
    context_len: int
    mask: torch.Tensor | None  # [query_len, context_len] True = may attend


@dataclass
class _DecodeGroup:
    """Decode tokens of similar context length, attended to in one call (padding to the
    group's longest context, not the batch's)."""

    token_indices: torch.Tensor
    block_table: torch.Tensor  # [group size, blocks covering the group's longest context]
    key_mask: torch.Tensor  # [group size, 1, 1, keys] True = valid key


@dataclass
class StorePlan:
    """Where the step's new keys/values go: their cache slots (tokens without one skipped)."""

    token_indices: torch.Tensor | None  # None: every token is stored
    slots: torch.Tensor


@dataclass
class _Plan:
    """Index tensors derived once per step from the metadata, shared by every layer."""

    store: StorePlan
    decode_groups: list[_DecodeGroup]
    prefills: list[PrefillSlice]


MIN_DECODE_GROUP = 8  # below this, a call's fixed cost outweighs the padding it saves


def _group_decodes(num_blocks: np.ndarray) -> list[np.ndarray]:
    """Split decode positions (longest context first) so that a group's shortest context
    needs more than half its longest one's blocks: padding wastes under half of each gather."""
    order = np.argsort(-num_blocks, kind="stable")
    groups: list[list[int]] = []
    for position in order:
        group = groups[-1] if groups else None
        if group is None or (
            len(group) >= MIN_DECODE_GROUP and 2 * num_blocks[position] <= num_blocks[group[0]]
        ):
            groups.append([position])
        else:
            group.append(position)
    return [np.asarray(group) for group in groups]


def _decode_group(md: AttentionMetadata, rows: np.ndarray) -> _DecodeGroup:
    """The decode tokens `rows` (indices into the metadata's decode token arrays)."""
    device = md.slot_mapping.device
    lens = md.decode_token_seq_lens_cpu[rows]
    num_blocks = int(-(-lens.max() // md.block_size))
    requests = torch.from_numpy(md.decode_token_requests_cpu[rows]).to(device)
    key_positions = torch.arange(num_blocks * md.block_size, device=device)
    key_mask = key_positions[None, :] < torch.from_numpy(lens).to(device)[:, None]
    return _DecodeGroup(
        token_indices=torch.from_numpy(md.decode_token_indices_cpu[rows]).to(device),
        block_table=md.block_table[requests, :num_blocks],
        key_mask=key_mask[:, None, None, :],
    )


def make_store_plan(md: AttentionMetadata) -> StorePlan:
    valid = md.slot_mapping >= 0
    if bool(valid.all()):
        return StorePlan(None, md.slot_mapping)
    token_indices = torch.nonzero(valid).squeeze(1)
    return StorePlan(token_indices, md.slot_mapping[token_indices])


def prefill_slices(md: AttentionMetadata) -> list[PrefillSlice]:
    """The step's prefill chunks, each with what its attention needs."""
    device = md.slot_mapping.device
    block_size = md.block_size
    prefills = []
    for req in md.prefill_indices_cpu:
        start, end = int(md.query_start_loc_cpu[req]), int(md.query_start_loc_cpu[req + 1])
        num_computed = int(md.num_computed_tokens_cpu[req])
        context_len = int(md.seq_lens_cpu[req])
        if num_computed == 0:
            prefills.append(PrefillSlice(start, end, None, context_len, None))
            continue
        blocks = md.block_table[req, : -(-context_len // block_size)]
        query_pos = torch.arange(num_computed, context_len, device=device)
        mask = torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]
        prefills.append(PrefillSlice(start, end, blocks, context_len, mask))
    return prefills


def _make_plan(md: AttentionMetadata) -> _Plan:
    decode_blocks = -(-md.decode_token_seq_lens_cpu // md.block_size)
    return _Plan(
        store=make_store_plan(md),
        decode_groups=[_decode_group(md, group) for group in _group_decodes(decode_blocks)],
        prefills=prefill_slices(md),
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, store: StorePlan
) -> None:
    """Write the step's new keys/values into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if store.token_indices is not None:
        key, value = key[store.token_indices], value[store.token_indices]
    key_cache.index_copy_(0, store.slots, key.to(key_cache.dtype))
    value_cache.index_copy_(0, store.slots, value.to(value_cache.dtype))


def as_cached(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """`x` as the cache holds it (rounded to its element type, e.g. a bfloat16 cache of a
    float32 model), in its own dtype: a chunk's own keys and values attended to as every later
    step reads them back (as vLLM's kernels read a chunk back from the cache)."""
    if kv_cache.dtype == x.dtype:
        return x
    return x.to(kv_cache.dtype).to(x.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store the new k/v, then causal attention of every request's queries over its whole
    context. query [T, H, D], key/value [T, KVH, D], kv_cache [2, blocks, block_size, KVH, D]."""
    if metadata.backend_plan is None:
        metadata.backend_plan = _make_plan(metadata)
    plan = metadata.backend_plan
    store_kv(key, value, kv_cache, plan.store)
    output = torch.empty_like(query)
    for group in plan.decode_groups:
        output[group.token_indices] = _decode_attention(
            query[group.token_indices], kv_cache, group, scale
        )
    attend_prefills(query, key, value, kv_cache, plan.prefills, scale, output)
    return output


# Reused gather buffers, one pair per (device, dtype). A fresh multi-MB allocation per layer
# costs page faults that made the gather 3-7x slower than the copy itself in a busy engine.
# Keyed by inference mode too: a buffer made under it cannot be written outside it.
_workspaces: dict[tuple[torch.device, torch.dtype, bool], torch.Tensor] = {}


def _workspace(like: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (like.device, like.dtype, torch.is_inference_mode_enabled())
    buffer = _workspaces.get(key)
    if buffer is None or buffer.numel() < 2 * numel:
        buffer = torch.empty(2 * numel, dtype=like.dtype, device=like.device)
        _workspaces[key] = buffer
    return buffer[:numel], buffer[numel : 2 * numel]


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the blocks of `block_ids` ([..., n]) out of one layer's cache [2, blocks,
    block_size, KVH, D] as keys and values [..., n * block_size, KVH, D], each with one
    index_select into a reused buffer (valid until the next call)."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat_ids = block_ids.reshape(-1)
    row = block_size * num_kv_heads * head_dim
    key_out, value_out = _workspace(kv_cache, flat_ids.numel() * row)
    shape = (*block_ids.shape[:-1], -1, num_kv_heads, head_dim)
    keys = torch.index_select(kv_cache[0].view(num_blocks, row), 0, flat_ids,
                              out=key_out.view(-1, row))  # fmt: skip
    values = torch.index_select(kv_cache[1].view(num_blocks, row), 0, flat_ids,
                                out=value_out.view(-1, row))  # fmt: skip
    return keys.view(shape), values.view(shape)


def widen(
    keys: torch.Tensor, values: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered keys and values in `like`'s dtype (a bfloat16 cache under a float32 model),
    in a reused buffer as the gather's own (valid until the next call)."""
    if keys.dtype == like.dtype:
        return keys, values
    key_out, value_out = _workspace(like, keys.numel())
    return key_out.view(keys.shape).copy_(keys), value_out.view(values.shape).copy_(values)


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup, scale: float
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    # Keys/values stay [B, keys, KVH, D] in memory; SDPA reads the transposed view in place.
    keys, values = widen(*gather_context(kv_cache, group.block_table), query)
    # GQA: each kv head's query heads become its "query tokens", so its keys are read once.
    grouped = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.key_mask,
        scale=scale,
    )
    return out.reshape(num_decodes, num_heads, head_dim)


def attend_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    prefills: list[PrefillSlice],
    scale: float,
    output: torch.Tensor,
) -> None:
    """Each prefill chunk's attention into its rows of `output`."""
    for chunk in prefills:
        output[chunk.query_start : chunk.query_end] = _prefill_attention(
            query, key, value, kv_cache, chunk, scale
        )


def chunk_keys_values(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillSlice,
    like: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a prefill chunk attends to, `[context_len, KVH, D]` in the model's
    dtype: its own as the cache holds them (rounded to its element type) when it is the whole
    context so far, else its context gathered from the cache (where its own were stored
    first) and widened to `like`'s dtype."""
    if chunk.context_block_ids is None:
        rows = slice(chunk.query_start, chunk.query_end)
        return as_cached(key[rows], kv_cache), as_cached(value[rows], kv_cache)
    keys, values = gather_context(kv_cache, chunk.context_block_ids)
    return widen(keys[: chunk.context_len], values[: chunk.context_len], like)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillSlice,
    scale: float,
) -> torch.Tensor:
    # [1, heads, tokens, D] views: with a batch dim SDPA takes its fused CPU kernel (3x faster
    # than the math fallback it uses for 3-D inputs with GQA).
    q = query[chunk.query_start : chunk.query_end].transpose(0, 1).unsqueeze(0)
    k, v = chunk_keys_values(key, value, kv_cache, chunk, query)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if chunk.context_block_ids is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)
