"""The dense fp32 matmul kernel (attention/csrc/dense_matmul.c) against float64 sums: odd
shapes, biases, strided inputs, every token-pass size; a row's output independent of the batch;
the AVX2 and plain-C builds; what it leaves to torch; the layers that use it."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from tandem.attention import cpu_kernel
from tandem.models.layers import Linear

from helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels

# (out, in): rows not a multiple of the 4 per pass, columns not of the vector width.
SHAPES = [(7, 40), (13, 33), (64, 576), (259, 1536)]
TOKENS = [1, 2, 3, 4, 5, 9]  # passes of 2 (AVX2) or 4 (AVX-512) and their remainders


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_equals_float64_sums(shape):
    torch.manual_seed(0)
    n, k = shape
    weight, bias = torch.randn(n, k), torch.randn(n)
    for tokens in TOKENS:
        wide = torch.randn(tokens, k + 5)
        x = wide[:, 2 : 2 + k]  # rows k + 5 apart
        for b in (bias, None):
            got = cpu_kernel.dense_matmul(x, weight, b)
            assert got is not None and got.dtype == torch.float32
            # fp32 sums of k products of unit normals, in another order than float64's
            torch.testing.assert_close(
                got.double(), reference(x, weight, b), rtol=0, atol=2e-5 * k**0.5
            )


def test_a_row_does_not_depend_on_the_batch():
    torch.manual_seed(1)
    weight, bias = torch.randn(259, 576), torch.randn(259)
    x = torch.randn(9, 576)
    batch = cpu_kernel.dense_matmul(x, weight, bias)
    for row in range(9):
        alone = cpu_kernel.dense_matmul(x[row : row + 1], weight, bias)
        assert torch.equal(alone[0], batch[row])


def test_threads_give_the_one_thread_result():
    """A matrix large enough for the threaded path: the threads split rows, not sums."""
    if torch.get_num_threads() == 1:
        pytest.skip("one thread here")
    torch.manual_seed(2)
    weight, x = torch.randn(1024, 576), torch.randn(3, 576)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernel.dense_matmul(x, weight)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(cpu_kernel.dense_matmul(x, weight), one)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2 + FMA; SSE2 only
def test_the_kernel_built_for_older_x86_gives_the_same_results(older_x86_kernels, march):
    function = older_x86_kernels(march).dense_matmul_f32
    function.argtypes = cpu_kernel.load_library().dense_matmul_f32.argtypes
    torch.manual_seed(3)
    for n, k in SHAPES:
        weight, bias = torch.randn(n, k), torch.randn(n)
        for tokens, b in ((1, bias), (3, None), (5, bias)):
            x = torch.randn(tokens, k)
            out = torch.empty(tokens, n)
            function(weight.data_ptr(), None if b is None else b.data_ptr(), n, k, x.data_ptr(),
                     k, tokens, out.data_ptr(), 1)  # fmt: skip
            expected = cpu_kernel.dense_matmul(x, weight, b)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_what_it_leaves_to_torch():
    x, weight = torch.randn(2, 64), torch.randn(8, 64)
    assert cpu_kernel.dense_matmul(x.bfloat16(), weight.bfloat16()) is None
    assert cpu_kernel.dense_matmul(x[None], weight) is None  # not [T, K]
    assert cpu_kernel.dense_matmul(x.t().contiguous().t(), weight) is None  # columns strided
    assert cpu_kernel.dense_matmul(x, weight.t().contiguous().t()) is None  # weight strided
    assert cpu_kernel.dense_matmul(x, torch.randn(8, 32)) is None  # widths differ
    assert cpu_kernel.dense_matmul(x, weight, torch.randn(4)) is None  # bias of another size
    assert cpu_kernel.dense_matmul(x, weight.requires_grad_()) is None  # autograd needs torch


def test_linear_uses_it_up_to_its_step_size(monkeypatch):
    torch.manual_seed(4)
    linear = Linear(64, 24, bias=True)
    torch.nn.init.normal_(linear.weight)
    torch.nn.init.normal_(linear.bias)
    linear.dense_max_tokens = 4
    calls = []
    kernel = cpu_kernel.dense_matmul
    monkeypatch.setattr(cpu_kernel, "dense_matmul",
                        lambda *args: calls.append(args[0].shape[0]) or kernel(*args))  # fmt: skip
    with torch.inference_mode():
        for tokens in (1, 4, 5):
            x = torch.randn(tokens, 64)
            torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
    assert calls == [1, 4]
