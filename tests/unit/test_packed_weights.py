"""GGUF weights kept packed (models/packed.py): the C kernel multiplies the file's blocks as
the dequantized fp32 matrix would (up to the order of the sums), torch's int4 op (where the C
kernel is not built) within bf16 rounding; a linear layer uses them only for steps of at most
`max_tokens` rows."""

from __future__ import annotations

import math
import platform
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tandem.attention import cpu_kernel
from tandem.models.layers import Linear, MergedLinear
from tandem.models.loader import attach_packed_weights
from tandem.models.packed import PackedWeight, QuantBlocks

from helpers import needs_cpu_kernels

QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
KERNELS = [
    pytest.param(True, id="c-kernel", marks=needs_cpu_kernels),
    pytest.param(False, id="torch"),
]


def quantized(
    rows: int, cols: int, quant_type: str, seed: int = 0
) -> tuple[np.ndarray, QuantBlocks]:
    """gguf's dequantized matrix and the blocks it came from."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block: d = 0
    weight[1, 32:64] = 3.0  # a constant block
    weight[2, :32] = np.linspace(-1, 1, 32)  # Q8_0 codes from -127 to 127
    raw = quantize(weight, GGMLQuantizationType[quant_type])
    reference = dequantize(raw, GGMLQuantizationType[quant_type]).reshape(rows, cols)
    return reference, QuantBlocks(raw.reshape(rows, -1), quant_type, cols)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_codes_dequantize_to_ggufs_weights(quant_type):
    reference, blocks = quantized(48, 96, quant_type)
    codes = blocks.int4_codes()
    assert codes.codes.min() >= 0 and codes.codes.max() <= 15
    assert codes.codes.shape == (48, 96 * codes.input_copies)
    np.testing.assert_allclose(codes.dequantize(), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_blocks_dequantize_to_ggufs_weights_bit_for_bit(quant_type):
    """The loader's own dequantization (torch ops) forms gguf's products exactly."""
    reference, blocks = quantized(48, 96, quant_type, seed=3)
    weights = blocks.dequantize()
    assert weights.dtype == torch.float32 and weights.shape == (48, 96)
    np.testing.assert_array_equal(weights.numpy().view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", KERNELS)
def test_packed_matmul_equals_the_dequantized_matrix(quant_type, rows, dtype, use_kernel):
    """11 rows: more than the C kernel's 4 or 8 per pass; 77 output rows: a partial group of 16,
    whose second half of 8 is partial too (torch's op takes multiples of 16 only)."""
    out_rows = 77 if use_kernel else 64
    reference, blocks = quantized(out_rows, 160, quant_type, seed=rows)
    packed = PackedWeight.from_blocks(blocks, max_tokens=16, use_kernel=use_kernel)
    assert (packed.codes is not None) == use_kernel
    x = torch.randn(rows, 160).to(dtype)
    bias = torch.randn(out_rows).to(dtype)
    out = packed.matmul(x, bias)
    assert out.dtype == dtype and out.shape == (rows, out_rows)
    expected = x.double() @ torch.from_numpy(reference).double().t() + bias.double()
    scale = expected.abs().max()
    if use_kernel and dtype == torch.float32:  # exact weights, fp32 sums
        assert (out.double() - expected).abs().max() <= 1e-5 * scale
    else:  # bf16 activations (and, in torch's op, scales) on the way in or out
        assert (out.double() - expected).abs().max() <= 2e-2 * scale


@needs_cpu_kernels
def test_the_c_kernel_reads_strided_rows():
    """A projection's input may be a view with a row stride (attention's output rows)."""
    reference, blocks = quantized(32, 64, "Q4_1")
    packed = PackedWeight.from_blocks(blocks, max_tokens=8)
    wide = torch.randn(3, 100)
    out = packed.matmul(wide[:, :64])
    expected = wide[:, :64] @ torch.from_numpy(reference).t()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_kernel", KERNELS)
def test_linear_uses_packed_weights_only_for_small_steps(use_kernel):
    reference, blocks = quantized(32, 64, "Q4_1")
    layer = Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(reference) * 2)  # a different matrix on purpose
    layer.packed = PackedWeight.from_blocks(blocks, max_tokens=4, use_kernel=use_kernel)
    x = torch.randn(5, 64)
    dense = x @ layer.weight.detach().t()
    packed = x.bfloat16().float() @ torch.from_numpy(reference).t()
    small = layer(x[:4])
    # Within 1% of the outputs' scale (torch's op rounds activations to bf16).
    torch.testing.assert_close(small, packed[:4], rtol=0, atol=1e-2 * packed.abs().max().item())
    torch.testing.assert_close(layer(x), dense)


def test_fused_shards_are_packed_in_row_order():
    """Q, K and V arrive as separate matrices; the packed QKV holds them in the dense order."""
    qkv = MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=False)
    parts = {name: quantized(size, 64, "Q4_0", seed=i) for i, (name, size) in
             enumerate({"q": 32, "k": 16, "v": 16}.items())}  # fmt: skip
    net = torch.nn.Module()
    net.add_module("attn", torch.nn.Module())
    net.attn.add_module("qkv_proj", qkv)
    matrices = iter([(f"attn.{name}_proj.weight", blocks) for name, (_, blocks) in parts.items()])
    assert attach_packed_weights(net, matrices, max_tokens=8) == qkv.packed.nbytes > 0
    reference = np.concatenate([parts[name][0] for name in ("q", "k", "v")])
    x = torch.randn(2, 64)
    expected = x.bfloat16().float() @ torch.from_numpy(reference).t()
    torch.testing.assert_close(qkv(x), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("use_kernel", KERNELS)
def test_q4_0_and_q4_1_shards_fuse(use_kernel, monkeypatch):
    """A fused layer whose shards mix Q4_0 and Q4_1 is packed whole (Q4_0 as Q4_1 blocks)."""
    if not use_kernel:  # as where no compiler builds the C kernel
        monkeypatch.setattr(cpu_kernel, "load_library", lambda: None)
    qkv = MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=False)
    net = torch.nn.Module()
    net.add_module("qkv_proj", qkv)
    kinds = {"q": "Q4_0", "k": "Q4_1", "v": "Q4_0"}
    parts = {name: quantized(rows, 64, kinds[name], seed=rows)
             for name, rows in {"q": 32, "k": 16, "v": 16}.items()}  # fmt: skip
    matrices = iter([(f"{name}_proj.weight", blocks) for name, (_, blocks) in parts.items()])
    assert attach_packed_weights(net, matrices, max_tokens=8) > 0
    assert (qkv.packed.codes is not None) == use_kernel
    reference = np.concatenate([parts[name][0] for name in ("q", "k", "v")])
    x = torch.randn(3, 64)
    expected = x.double() @ torch.from_numpy(reference).double().t()
    bound = (1e-5 if use_kernel else 2e-2) * expected.abs().max()
    assert (qkv(x).double() - expected).abs().max() <= bound


def test_shards_of_different_kinds_stay_dense():
    qkv = MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=False)
    net = torch.nn.Module()
    net.add_module("qkv_proj", qkv)
    parts = [("q_proj", 32, "Q4_0"), ("k_proj", 16, "Q8_0"), ("v_proj", 16, "Q4_0")]
    matrices = iter(
        [(f"{name}.weight", quantized(size, 64, kind)[1]) for name, size, kind in parts]
    )
    assert attach_packed_weights(net, matrices, max_tokens=8) == 0 and qkv.packed is None


def test_a_layer_with_a_shard_in_another_format_stays_dense():
    qkv = MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=False)
    net = torch.nn.Module()
    net.add_module("qkv_proj", qkv)
    _, blocks = quantized(32, 64, "Q4_0")
    assert attach_packed_weights(net, iter([("q_proj.weight", blocks)]), max_tokens=8) == 0
    assert qkv.packed is None


@needs_cpu_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2 + FMA + F16C; SSE2 only
def test_the_c_kernel_built_for_older_x86_gives_the_same_results(older_x86_kernels, march):
    """The machines tandem runs on differ (AVX2 only, AVX-512): the kernel's AVX2 and plain-C
    paths (int8 Q4 at 20 rows: AVX2's wide kernel) give the native build's results."""
    function = older_x86_kernels(march).packed_matmul_f32
    function.argtypes = cpu_kernel._PACKED_MATMUL_ARGTYPES
    torch.manual_seed(0)
    for quant_type in QUANT_TYPES:
        _, blocks = quantized(59, 160, quant_type)  # a last group of 11 rows: 8 and 3
        packed = PackedWeight.from_blocks(blocks, max_tokens=32)
        for int8, native in ((0, packed), (1, replace(packed, int8_min_tokens=1))):
            for rows in (1, 3, 11, 20):  # from 16 rows int8 Q4 takes AVX2's wide kernel
                x = torch.randn(rows, 160)
                out = torch.empty(rows, 59)
                function(packed.codes.data_ptr(), packed.scales.data_ptr(),
                         cpu_kernel.QUANT_TYPE_IDS[packed.quant_type], 59, 160, x.data_ptr(),
                         160, rows, out.data_ptr(), int8, 1)  # fmt: skip
                # Sums of 160 products in another order: ~1e-5 apart; int8: Q8_0's offset codes
                # (VNNI) also subtract 128·Σ d_x·q_x in fp32.
                tolerance = 2e-4 if int8 else 5e-5
                torch.testing.assert_close(out, native.matmul(x), rtol=1e-5, atol=tolerance)


@needs_cpu_kernels
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("int8_min_tokens", [0, 1], ids=["fp32-activations", "int8"])
def test_matmul_argmax_is_the_matmul_and_argmax_rows(quant_type, int8_min_tokens, monkeypatch):
    """One row through the LM head's fused pass: the products bit for bit as `matmul` makes
    them, and the first argmax as argmax_rows finds it, whichever thread's columns hold it:
    repeated maxima across the threads' slices (duplicated weight rows), maxima in the last,
    partial group of 16, infinities, NaNs and a row of NaNs; 1 to 5 threads."""
    reference, blocks = quantized(203, 96, quant_type, seed=5)
    raw = blocks.data.copy()
    raw[150] = raw[7]  # the same products at 7 and 150: 7 is the first
    raw[201] = raw[200]
    packed = PackedWeight.from_blocks(replace(blocks, data=raw), max_tokens=4,
                                      int8_min_tokens=int8_min_tokens)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, 96, generator=generator) for _ in range(20)]
    rows[1][0, 5] = math.inf  # +inf, -inf and NaN (inf times a zero weight) products
    rows[2][0, 0] = math.nan
    rows[3][0, :] = 0.0  # every product 0: the first index
    rows[5] = torch.from_numpy(reference[7:8]).clone()  # rows 7 and 150 tie at the maximum
    rows[6] = torch.from_numpy(reference[200:201]).clone()  # 200 and 201, the partial group
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        for x in rows:
            found = packed.matmul_argmax(x)
            assert found is not None
            logits, token = found
            expected = packed.matmul(x)
            assert torch.equal(logits.view(torch.int32), expected.view(torch.int32))
            assert token.tolist() == cpu_kernel.argmax_rows(expected).tolist()
        assert [packed.matmul_argmax(rows[i])[1].item() for i in (5, 6)] == [7, 200]
    if not int8_min_tokens:  # exact weights and activations: the dequantized matrix's argmax
        top = rows[4] @ torch.from_numpy(reference).t()
        assert packed.matmul_argmax(rows[4])[1].item() == top.argmax().item()


@needs_cpu_kernels
def test_matmul_argmax_only_where_the_kernel_multiplies_one_row():
    _, blocks = quantized(32, 64, "Q8_0")
    one, two = torch.randn(1, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="64 inputs got rows of 32"):
        PackedWeight.from_blocks(blocks, 4).matmul_argmax(torch.randn(1, 32))
    assert PackedWeight.from_blocks(blocks, 4).matmul_argmax(two) is None
    assert PackedWeight.from_blocks(blocks, 4, use_kernel=False).matmul_argmax(one) is None
    assert PackedWeight.from_blocks(blocks, 4).matmul_argmax(one) is not None


@needs_cpu_kernels
def test_matmul_argmax_with_more_threads_than_row_groups(monkeypatch):
    """20 output rows are two groups of 16: with 5 threads most take none, and the answer
    still comes from the slices that hold columns."""
    reference, blocks = quantized(20, 64, "Q8_0", seed=2)
    packed = PackedWeight.from_blocks(blocks, max_tokens=4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    for row in (0, 17):
        x = torch.from_numpy(reference[row : row + 1]).clone()
        logits, token = packed.matmul_argmax(x)
        assert torch.equal(logits, packed.matmul(x)) and token.item() == row
