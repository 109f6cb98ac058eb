"""The Triton paged-attention backend against the torch backend (the oracle), on CPU under
TRITON_INTERPRET=1 at small shapes (on a CUDA machine, on the GPU): mixed batches, GQA ratios,
split-KV decode, the causal offset of chunks with cached context, and the store kernel."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
pytest.importorskip("triton")

from tandem.attention.backends import resolve_attention_backend

from helpers import attention_tolerance as tolerance
from helpers import compare_attention_backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_both(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    return compare_attention_backends(
        shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, DEVICE
    )


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(6, 2, 16), (4, 4, 32), (8, 1, 16), (10, 2, 24)]
)
def test_mixed_batch_matches_torch_backend(num_heads, num_kv_heads, head_dim):
    """Fresh prompts, chunks after cached context, decodes and draft verification in one
    step; GQA groups of 3 (padded to 4), 1, 8 and 5; a head size that is not a power of 2."""
    shapes = [(0, 37), (20, 13), (50, 1), (33, 4), (0, 1), (15, 1), (16, 16), (70, 2)]
    expected, expected_cache, got, got_cache, plan = run_both(
        shapes, num_heads, num_kv_heads, head_dim, 16, torch.float32
    )
    assert plan.num_splits == 1
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))
    assert torch.equal(got_cache, expected_cache)  # the store kernel wrote every slot


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_matches_torch_backend(dtype):
    shapes = [(0, 21), (40, 1), (17, 3)]
    expected, expected_cache, got, got_cache, _ = run_both(shapes, 6, 2, 16, 16, dtype, seed=1)
    assert torch.equal(got_cache, expected_cache)
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        # The interpreter's tl.dot misreads bf16 operands (a 16x16 bf16 product comes out
        # off by ~1e10), so on CPU only the store is checked; the GPU checks the rest.
        return
    torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))


def test_long_decodes_split_the_context():
    """A decode-only step with few programs splits each context into ranges and merges them;
    a short context next to long ones leaves some of its ranges empty."""
    rng = random.Random(3)
    shapes = [(rng.randint(400, 700), 1) for _ in range(3)] + [(5, 1), (300, 3)]
    expected, _, got, _, plan = run_both(shapes, 4, 2, 16, 16, torch.float32, seed=3)
    assert plan.num_splits > 1
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("block_size", [32, 8, 5])
def test_any_block_size_and_chunk_spanning_programs(block_size):
    """Tiles of keys are independent of the cache's block size (each key looks its block
    up): blocks of 32, 8 and 5 tokens; a chunk long enough to take several programs."""
    shapes = [(45, 100), (0, 70), (9, 1), (77, 2)]
    expected, expected_cache, got, got_cache, plan = run_both(
        shapes, 6, 2, 16, block_size, torch.float32, seed=2
    )
    assert len(plan.program_request) > len(shapes)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))
    assert torch.equal(got_cache, expected_cache)


def test_backend_choice():
    """auto: cpu on CPU (where its kernel builds; tests/unit/test_cpu_attention.py), triton on
    CUDA; triton asked for on CPU only under the interpreter; vLLM's names are taken; others
    refused with the choices."""
    assert resolve_attention_backend("auto", "cpu") in ("cpu", "torch")
    assert resolve_attention_backend(None, "cuda") == "triton"
    assert resolve_attention_backend("TORCH_SDPA", "cpu") == "torch"
    assert resolve_attention_backend("TRITON_ATTN", "cuda:1") == "triton"
    assert resolve_attention_backend("triton", "cpu") == "triton"  # interpreter set above
    with pytest.raises(ValueError, match="not one of"):
        resolve_attention_backend("flash", "cuda")


@pytest.mark.parametrize("seed", range(8))
def test_random_steps_match_torch_backend(seed):
    """Random layouts and steps: blocks larger than a tile (64, 128), contexts ending on and
    off tile edges, chunks of every length, GQA groups that are and are not powers of two."""
    rng = random.Random(100 + seed)
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.choice([1, 3, 4, 7])
    head_dim = rng.choice([16, 40, 64])
    block_size = rng.choice([5, 16, 64, 128])
    shapes = [
        (rng.choice([0, rng.randint(1, 300), 32 * rng.randint(1, 8)]),
         rng.choice([1, 1, 2, 16, rng.randint(1, 90)]))
        for _ in range(rng.randint(1, 9))
    ]  # fmt: skip
    expected, expected_cache, got, got_cache, _ = run_both(
        shapes, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=seed
    )
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))
    assert torch.equal(got_cache, expected_cache)
