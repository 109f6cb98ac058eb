"""The torch paged-attention backend and the batch builder against dense reference attention."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.attention.metadata import build_batch
from tandem.attention.torch_backend import paged_attention

from helpers import Slice


def dense_causal_attention(q, k, v, num_computed: int, scale: float) -> torch.Tensor:
    """q [L, H, D] at positions num_computed.., k/v [S, KVH, D] for positions 0..S-1."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    query_pos = torch.arange(num_computed, num_computed + q.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 4), (6, 2, 16), (12, 2, 8)])
def test_mixed_batch_matches_dense(num_heads, num_kv_heads, block_size):
    """Decodes, first chunks and later chunks in one call; blocks scattered through the pool."""
    # (num_computed_tokens, num_new_tokens) per request
    shapes = [(20, 1), (0, 13), (37, 9), (5, 1), (0, 1), (16, 16), (63, 1)]
    check_against_dense(shapes, num_heads, num_kv_heads, block_size, num_blocks=64)


def test_many_decodes_of_mixed_lengths_match_dense():
    """Enough decodes of spread-out lengths that they are split into several length groups."""
    rng = random.Random(1)
    shapes = [(rng.randint(0, 300), 1) for _ in range(40)] + [(0, 7), (90, 5)]
    check_against_dense(shapes, num_heads=6, num_kv_heads=2, block_size=8, num_blocks=1700)


def check_against_dense(shapes, num_heads, num_kv_heads, block_size, num_blocks):
    torch.manual_seed(0)
    rng = random.Random(0)
    head_dim = 32
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    full_k, full_v, slices = [], [], []
    for computed, new in shapes:
        total = computed + new
        blocks = [pool.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, num_kv_heads, head_dim)
        v = torch.randn(total, num_kv_heads, head_dim)
        for pos in range(computed):  # what earlier steps stored
            kv_cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
        slices.append(Slice(list(range(total)), computed, new, blocks))
    batch = build_batch(slices, block_size, torch.device("cpu"))
    num_tokens = sum(new for _, new in shapes)
    q = torch.randn(num_tokens, num_heads, head_dim)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    scale = head_dim**-0.5
    out = paged_attention(q, new_k, new_v, kv_cache, batch.attn_metadata, scale)

    offset = 0
    for (computed, new), k, v, s in zip(shapes, full_k, full_v, slices, strict=True):
        expected = dense_causal_attention(q[offset : offset + new], k, v, computed, scale)
        torch.testing.assert_close(out[offset : offset + new], expected, rtol=1e-5, atol=1e-5)
        # The new tokens' k/v landed in their slots.
        for pos in range(computed, computed + new):
            block, slot = s.block_ids[pos // block_size], pos % block_size
            assert torch.equal(kv_cache[0, block, slot], k[pos])
            assert torch.equal(kv_cache[1, block, slot], v[pos])
        offset += new


def test_build_batch_positions_and_slots():
    slices = [Slice(list(range(100, 130)), 27, 3, [7, 2]), Slice([5, 6, 7, 8, 9], 0, 5, [4])]
    batch = build_batch(slices, 16, torch.device("cpu"), sample_mask=[False, True])
    assert batch.input_ids.tolist() == [127, 128, 129, 5, 6, 7, 8, 9]
    assert batch.positions.tolist() == [27, 28, 29, 0, 1, 2, 3, 4]
    assert batch.attn_metadata.slot_mapping.tolist() == [
        2 * 16 + 11, 2 * 16 + 12, 2 * 16 + 13, 64, 65, 66, 67, 68,
    ]  # fmt: skip
    assert batch.attn_metadata.seq_lens_cpu.tolist() == [30, 5]
    assert batch.logits_indices.tolist() == [7]
    # A request with a few new tokens (after its first step or not) is attended to in the
    # batched decode calls, each token over the positions up to its own.
    metadata = batch.attn_metadata
    assert metadata.decode_token_indices_cpu.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert metadata.decode_token_requests_cpu.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert metadata.decode_token_seq_lens_cpu.tolist() == [28, 29, 30, 1, 2, 3, 4, 5]
    assert metadata.prefill_indices_cpu.tolist() == []
    # More than MAX_DECODE_QUERY new tokens: a prefill chunk, attended to in one call.
    longer = [Slice([1, 2], 1, 1, [0]), Slice(list(range(17)), 0, 17, [1, 2])]
    metadata = build_batch(longer, 16, torch.device("cpu")).attn_metadata
    assert metadata.decode_token_indices_cpu.tolist() == [0]
    assert metadata.prefill_indices_cpu.tolist() == [1]


def test_build_batch_draft_tokens_and_their_logits_rows():
    """Drafts follow a request's known tokens; a sampled request gets logits at its last
    known token and every draft."""
    slices = [Slice([1, 2, 3], 2, 3, [0]), Slice([7, 8], 1, 1, [1]), Slice([4, 5], 1, 2, [2])]
    batch = build_batch(slices, 16, torch.device("cpu"), draft_token_ids=[[40, 41], [], [50]])
    assert batch.input_ids.tolist() == [3, 40, 41, 8, 5, 50]
    assert batch.positions.tolist() == [2, 3, 4, 1, 1, 2]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]
    masked = build_batch(
        slices, 16, torch.device("cpu"), [True, False, True], None, [[40, 41], [], [50]]
    )
    assert masked.logits_indices.tolist() == [0, 1, 2, 4, 5]


def test_build_batch_prompt_logits_rows_and_targets():
    """Rows of the positions to score, request by request, and the token after each."""
    slices = [
        Slice(list(range(100, 130)), 8, 10, [1, 2]),  # positions 8..17 in rows 0..9
        Slice([5, 6, 7], 2, 1, [3]),  # a decode: nothing to score
        Slice(list(range(200, 240)), 0, 16, [4, 5, 6]),  # rows 11..26
    ]
    batch = build_batch(slices, 16, torch.device("cpu"), None, [(10, 14), (0, 0), (0, 16)])
    prompt = batch.prompt_logits
    assert prompt.indices.tolist() == [2, 3, 4, 5, *range(11, 27)]
    assert prompt.target_ids.tolist() == [111, 112, 113, 114, *range(201, 217)]
    assert prompt.num_rows.tolist() == [4, 0, 16]
    assert batch.logits_indices.tolist() == [9, 10, 26]  # sampling rows unchanged
    assert build_batch(slices, 16, torch.device("cpu")).prompt_logits is None


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([(7, 9)], "outside the request's new tokens"),
        ([(9, 19)], "outside the request's new tokens"),
        ([(9, 18)], "no next token"),
        ([(0, 0), (0, 0)], "one range per request"),
    ],
)
def test_build_batch_rejects_bad_prompt_logits_ranges(ranges, message):
    with pytest.raises(ValueError, match=message):
        build_batch([Slice(list(range(18)), 8, 10, [0, 1])], 16, torch.device("cpu"), None, ranges)


def test_build_batch_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table is too short"):
        build_batch([Slice(list(range(20)), 0, 20, [0])], 16, torch.device("cpu"))


def test_negative_slots_are_not_stored():
    """slot -1 (padding) leaves the cache untouched."""
    kv_cache = torch.zeros(2, 2, 4, 1, 8)
    batch = build_batch([Slice([1, 2], 0, 2, [1])], 4, torch.device("cpu"))
    batch.attn_metadata.slot_mapping[1] = -1
    k = torch.ones(2, 1, 8)
    paged_attention(torch.ones(2, 1, 8), k, k, kv_cache, batch.attn_metadata, 1.0)
    assert kv_cache[0, 1, 0].sum() == 8 and kv_cache[0, 1, 1].sum() == 0
    assert kv_cache[:, 0].abs().sum() == 0


def test_step_inputs_go_to_the_device_in_one_copy():
    """A GPU step's inputs travel packed in one buffer (pack, then split_like on the device):
    every array comes back with its values and shape (2-D block tables, empty arrays, other
    integer types), each a separate view. On CPU copy_to_device hands back the arrays."""
    import numpy as np

    from tandem.attention.metadata import copy_to_device, pack, split_like

    arrays = [np.arange(5), np.arange(12).reshape(3, 4) * 7, np.zeros(0, dtype=np.int64),
              np.array([3, -1], dtype=np.int32)]  # fmt: skip
    for tensors in (split_like(pack(arrays, pin=False), arrays),
                    copy_to_device(arrays, torch.device("cpu"))):  # fmt: skip
        for tensor, array in zip(tensors, arrays, strict=True):
            assert tensor.dtype == torch.int64 and tensor.shape == array.shape
            assert tensor.tolist() == array.tolist()
    packed = split_like(pack(arrays, pin=False), arrays)
    assert all(part.storage_offset() % 2 == 0 for part in packed)  # 16-byte aligned views
    packed[0].fill_(-9)
    assert packed[1].tolist() == (np.arange(12).reshape(3, 4) * 7).tolist()
