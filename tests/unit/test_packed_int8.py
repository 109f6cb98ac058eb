"""The packed GGUF matmul with int8 activations (csrc/packed_matmul_int8.c): each token row is
quantized per 8 columns, with scales that are whole multiples of a unit per 32, and the product
equals the dequantized weights times the dequantized activations up to fp32 rounding, on the
per-token path and on the wide one (from 16 rows); a row's result does not depend on the
rows beside it; a layer uses it only from `int8_min_tokens` rows, the LM head too."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from test_packed_weights import QUANT_TYPES, quantized

from tandem.attention import cpu_kernel
from tandem.models.layers import Linear
from tandem.models.loader import attach_packed_weights
from tandem.models.packed import PackedWeight, QuantBlocks

from helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


def int8_weight(quant_type: str, rows: int = 50, cols: int = 160, seed: int = 0):
    reference, blocks = quantized(rows, cols, quant_type, seed)
    packed = PackedWeight.from_blocks(blocks, max_tokens=64, int8_min_tokens=1)
    return torch.from_numpy(reference).double(), packed


def activations(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[-1, 32:64] = 1e-29  # a tiny one
    x[-1, 64:96] *= 1e4  # a large one
    x[-1, 96:104] *= 1e-3  # an 8 far below the rest of its 32
    return x


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, the scale of every 8 columns (k units) and the sums of every 32."""
    codes, units, multiples, sums = cpu_kernel.quantize_rows_int8(x)
    return codes, units.repeat_interleave(4, dim=1) * multiples.float(), sums


def test_activations_round_to_the_nearest_of_127_steps_per_8_columns():
    x = activations(5, 160)
    codes, units, multiples, sums = cpu_kernel.quantize_rows_int8(x)
    _, scales, _ = quantized_activations(x)
    groups = x.reshape(5, 20, 8)
    amax = groups.abs().amax(-1)
    assert codes.abs().max() <= 127
    # Each 8's scale is the fewest units that cover its largest value, the block's largest K.
    assert multiples.min() >= 0 and multiples.max() == 2048
    assert (multiples.reshape(5, 5, 4).amax(-1)[units > 0] == 2048).all()
    torch.testing.assert_close(
        units, x.reshape(5, 5, 32).abs().amax(-1) / (127 * 2048), rtol=1e-6, atol=0
    )
    assert (scales >= amax / 127 * (1 - 1e-6)).all()
    assert (scales <= amax / 127 + units.repeat_interleave(4, dim=1) * (1 + 1e-6)).all()
    assert multiples[-1, 12] < 8  # the small 8: its own scale, not its block's
    dequantized = codes.reshape(5, 20, 8).float() * scales[..., None]
    assert ((dequantized - groups).abs() <= scales[..., None] * (0.5 + 1e-5)).all()
    assert (codes[0, :32] == 0).all() and (scales[0, :4] == 0).all() and units[0, 0] == 0
    # Sums of 32 terms in another order: within fp32 rounding of their magnitudes.
    magnitudes = dequantized.abs().reshape(5, 5, 32).sum(-1)
    assert ((sums - dequantized.reshape(5, 5, 32).sum(-1)).abs() <= 1e-6 * magnitudes).all()


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 20, 37])
def test_int8_matmul_equals_the_dequantized_product(quant_type, rows):
    """59 output rows: a last group of 11 (the wide path's tiles of 8 rows: 8 and 3); 11 rows:
    two passes of 8; from 16 rows the wide path (20 and 37: a partial vector of 8 tokens)."""
    weight, packed = int8_weight(quant_type, rows=59)
    x = activations(rows, 160, seed=rows)
    codes, scales, _ = quantized_activations(x)
    x_int8 = (codes.reshape(rows, 20, 8).double() * scales[..., None].double()).reshape(rows, 160)
    expected = x_int8 @ weight.T
    got = packed.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 59)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    # ... which is the fp32 product up to the activations' rounding.
    exact = x.double() @ weight.T
    assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("tokens", [5, 20])
def test_a_q8_0_code_of_minus_128_counts_as_minus_128(tokens):
    """GGUF's quantizer writes codes within ±127, but a file may hold int8's −128; the AVX2
    path takes Q8_0 codes as magnitudes, whose |−128| must read as 128, and the wide one
    (20 tokens) leaves the row groups holding one (rows 0-47 here, not 48-49) to it."""
    _, blocks = quantized(50, 160, "Q8_0")
    data = blocks.data.copy()
    data[3:40:3, 2:34:5] = 0x80  # codes of the first block of every third row (after fp16 d)
    blocks = QuantBlocks(data, "Q8_0", 160)
    weight = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0).reshape(50, 160)).double()
    d = float(data[3, :2].view(np.float16)[0])
    assert weight[3, 0] == -128 * d != 0
    packed = PackedWeight.from_blocks(blocks, max_tokens=64, int8_min_tokens=1)
    x = activations(tokens, 160)
    codes, scales, _ = quantized_activations(x)
    x_int8 = (codes.reshape(tokens, 20, 8).double() * scales[..., None].double()).reshape(
        tokens, 160
    )
    expected = x_int8 @ weight.T
    got = packed.matmul(x).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    fp32 = replace(packed, int8_min_tokens=0).matmul(x).double()
    exact = x.double() @ weight.T
    torch.testing.assert_close(fp32, exact, rtol=1e-5, atol=1e-5 * exact.abs().max())


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_a_rows_result_does_not_depend_on_its_batch(quant_type):
    _, packed = int8_weight(quant_type, rows=40, cols=96)
    x = torch.randn(19, 96)
    together = packed.matmul(x)
    for index in range(19):
        assert torch.equal(packed.matmul(x[index : index + 1])[0], together[index])


def test_bf16_activations_go_through_fp32():
    _, packed = int8_weight("Q4_1")
    x = torch.randn(6, 160).bfloat16()
    got = packed.matmul(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, packed.matmul(x.float()).bfloat16(), rtol=0, atol=0)


def test_a_layer_quantizes_only_from_int8_min_tokens_rows():
    _, blocks = quantized(50, 160, "Q8_0")
    fp32_only = PackedWeight.from_blocks(blocks, max_tokens=64)
    from_four = replace(fp32_only, int8_min_tokens=4)
    every = replace(fp32_only, int8_min_tokens=1)
    x = torch.randn(4, 160)
    assert torch.equal(from_four.matmul(x[:3]), fp32_only.matmul(x[:3]))
    assert torch.equal(from_four.matmul(x), every.matmul(x))
    assert not torch.equal(every.matmul(x), fp32_only.matmul(x))


def test_layers_and_the_lm_head_take_the_probes_choice():
    layer = Linear(160, 50, bias=False)
    net = torch.nn.Module()
    net.add_module("proj", layer)
    net.lm_head_checkpoint_name = "head"
    _, layer_blocks = quantized(50, 160, "Q4_1")
    _, head_blocks = quantized(64, 160, "Q8_0", seed=1)
    matrices = iter([("proj.weight", layer_blocks), ("head.weight", head_blocks)])
    assert attach_packed_weights(net, matrices, max_tokens=16, int8_min_tokens=2) > 0
    assert layer.packed.int8_min_tokens == net.lm_head_packed.int8_min_tokens == 2
