"""The triton attention backend at full size on a GPU, against the torch backend on the same
device (skipped without CUDA; on CPU the same comparisons run small, under the interpreter:
tests/unit/test_triton_attention.py). Llama-3-8B's head layout (32 query heads, 8 kv heads of
128) in bf16: a mixed step, long decodes that split their contexts, and block sizes other
than 16."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import attention_tolerance, compare_attention_backends

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def compare(shapes, block_size=16, dtype=torch.bfloat16, seed=0):
    expected, expected_cache, got, got_cache, plan = compare_attention_backends(
        shapes, 32, 8, 128, block_size, dtype, seed, torch.device("cuda"), "cuda"
    )
    torch.testing.assert_close(got.float(), expected.float(), **attention_tolerance(dtype))
    assert torch.equal(got_cache, expected_cache)
    return plan


def test_mixed_step():
    rng = random.Random(0)
    shapes = [(1000, 2048), (300, 5), (0, 517)] + [(rng.randint(1, 4096), 1) for _ in range(64)]
    assert compare(shapes).num_splits == 1


def test_long_decodes_split_their_contexts():
    rng = random.Random(1)
    shapes = [(rng.randint(2048, 16384), 1) for _ in range(4)]
    assert compare(shapes, seed=1).num_splits > 1


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_sizes_and_dtypes(block_size, dtype):
    rng = random.Random(2)
    shapes = [(rng.randint(0, 3000), rng.choice([1, 1, 4, 300])) for _ in range(24)]
    compare(shapes, block_size, dtype, seed=2)
