"""Reference paged attention in plain torch: the CPU path and the oracle for other backends.

Decode requests (one query token) are attended to together in one batched call over their
gathered block tables; prefill chunks (few per step) go one request at a time through SDPA, with
a causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.attention.metadata import AttentionMetadata


@dataclass
class _PrefillSlice:
    query_start: int
    query_end: int
    # None when the chunk is the whole context so far: attend to the fresh k/v, plain causal.
    context_block_ids: torch.Tensor | None
    context_len: int
    mask: torch.Tensor | None  # [query_len, context_len] True = may attend


@dataclass
class _Plan:
    """Index tensors derived once per step from the metadata, shared by every layer."""

    store_token_indices: torch.Tensor | None  # None: every token is stored
    store_slots: torch.Tensor
    decode_token_indices: torch.Tensor
    decode_block_table: torch.Tensor  # [num_decodes, blocks covering the longest context]
    decode_key_mask: torch.Tensor  # [num_decodes, 1, 1, keys] True = valid key
    prefills: list[_PrefillSlice]


def _make_plan(md: AttentionMetadata) -> _Plan:
    device = md.slot_mapping.device
    block_size = md.block_size
    valid = md.slot_mapping >= 0
    all_valid = bool(valid.all())
    store_token_indices = None if all_valid else torch.nonzero(valid).squeeze(1)
    store_slots = md.slot_mapping if all_valid else md.slot_mapping[store_token_indices]

    decodes = md.decode_indices_cpu
    decode_lens = md.seq_lens_cpu[decodes]
    num_blocks = int(-(-decode_lens.max() // block_size)) if len(decodes) else 0
    decodes_dev = torch.from_numpy(decodes).to(device)
    key_positions = torch.arange(num_blocks * block_size, device=device)
    decode_lens_dev = torch.from_numpy(decode_lens).to(device)
    decode_key_mask = key_positions[None, :] < decode_lens_dev[:, None]

    prefills = []
    for req in md.prefill_indices_cpu:
        start, end = int(md.query_start_loc_cpu[req]), int(md.query_start_loc_cpu[req + 1])
        num_computed = int(md.num_computed_tokens_cpu[req])
        context_len = int(md.seq_lens_cpu[req])
        if num_computed == 0:
            prefills.append(_PrefillSlice(start, end, None, context_len, None))
            continue
        blocks = md.block_table[req, : -(-context_len // block_size)]
        query_pos = torch.arange(num_computed, context_len, device=device)
        mask = torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]
        prefills.append(_PrefillSlice(start, end, blocks, context_len, mask))

    return _Plan(
        store_token_indices=store_token_indices,
        store_slots=store_slots,
        decode_token_indices=md.query_start_loc[decodes_dev],
        decode_block_table=md.block_table[decodes_dev, :num_blocks],
        decode_key_mask=decode_key_mask[:, None, None, :],
        prefills=prefills,
    )


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan) -> None:
    """Write the step's new keys/values into their cache slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    if plan.store_token_indices is not None:
        key, value = key[plan.store_token_indices], value[plan.store_token_indices]
    key_cache.index_copy_(0, plan.store_slots, key)
    value_cache.index_copy_(0, plan.store_slots, value)


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
    store_kv(key, value, kv_cache, plan)
    output = torch.empty_like(query)
    if len(plan.decode_token_indices):
        output[plan.decode_token_indices] = _decode_attention(
            query[plan.decode_token_indices], kv_cache, plan, scale
        )
    for chunk in plan.prefills:
        output[chunk.query_start : chunk.query_end] = _prefill_attention(
            query, key, value, kv_cache, chunk, scale
        )
    return output


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float
) -> torch.Tensor:
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    # [B, blocks, block_size, KVH, D] -> [B, KVH, keys, D]
    keys = kv_cache[0][plan.decode_block_table].flatten(1, 2).transpose(1, 2)
    values = kv_cache[1][plan.decode_block_table].flatten(1, 2).transpose(1, 2)
    # GQA without repeating the cache: group the query heads of each kv head.
    grouped = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    scores.masked_fill_(~plan.decode_key_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(num_decodes, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: _PrefillSlice,
    scale: float,
) -> torch.Tensor:
    q = query[chunk.query_start : chunk.query_end].transpose(0, 1)
    if chunk.context_block_ids is None:
        k = key[chunk.query_start : chunk.query_end].transpose(0, 1)
        v = value[chunk.query_start : chunk.query_end].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    k = kv_cache[0][chunk.context_block_ids].flatten(0, 1)[: chunk.context_len].transpose(0, 1)
    v = kv_cache[1][chunk.context_block_ids].flatten(0, 1)[: chunk.context_len].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)
