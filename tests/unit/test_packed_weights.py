"""GGUF weights kept packed (models/packed.py): the codes are gguf's own (Q8_0 as two int4
halves), the int4 kernel multiplies them as the dequantized matrix would, and a linear layer
uses them only for steps of at most `max_tokens` rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tandem.models.layers import Linear, MergedLinear
from tandem.models.loader import attach_packed_weights
from tandem.models.packed import Int4Codes, PackedWeight, unpack_blocks

QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def quantized(rows: int, cols: int, quant_type: str, seed: int = 0) -> tuple[np.ndarray, Int4Codes]:
    """gguf's dequantized matrix and our codes for the same blocks."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    weight[0, :32] = 0.0  # an all-zero block: d = 0
    weight[1, 32:64] = 3.0  # a constant block
    weight[2, :32] = np.linspace(-1, 1, 32)  # Q8_0 codes from -127 to 127
    raw = quantize(weight, GGMLQuantizationType[quant_type])
    reference = dequantize(raw, GGMLQuantizationType[quant_type]).reshape(rows, cols)
    return reference, unpack_blocks(raw, quant_type, (rows, cols))


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_codes_dequantize_to_ggufs_weights(quant_type):
    reference, codes = quantized(48, 96, quant_type)
    assert codes.codes.min() >= 0 and codes.codes.max() <= 15
    assert codes.codes.shape == (48, 96 * codes.input_copies)
    np.testing.assert_allclose(codes.dequantize(), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_packed_matmul_equals_the_dequantized_matrix(quant_type, rows):
    reference, codes = quantized(64, 160, quant_type, seed=rows)
    packed = PackedWeight.from_codes(codes, max_tokens=8)
    x = torch.randn(rows, 160)
    bias = torch.randn(64)
    out = packed.matmul(x, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 64)
    # Exact weights; the activations and scales are rounded to bf16 on the way in.
    expected = x.bfloat16().double() @ torch.from_numpy(reference).double().t() + bias.double()
    scale = expected.abs().max()
    assert (out.double() - expected).abs().max() <= 2e-2 * scale


def test_linear_uses_packed_weights_only_for_small_steps():
    reference, codes = quantized(32, 64, "Q4_1")
    layer = Linear(64, 32, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(reference) * 2)  # a different matrix on purpose
    layer.packed = PackedWeight.from_codes(codes, max_tokens=4)
    x = torch.randn(5, 64)
    dense = x @ layer.weight.detach().t()
    packed = x.bfloat16().float() @ torch.from_numpy(reference).t()
    small = layer(x[:4])
    # bf16 activations and outputs: within 1% of the outputs' scale.
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
    matrices = iter([(f"attn.{name}_proj.weight", codes) for name, (_, codes) in parts.items()])
    assert attach_packed_weights(net, matrices, max_tokens=8) == qkv.packed.nbytes > 0
    reference = np.concatenate([parts[name][0] for name in ("q", "k", "v")])
    x = torch.randn(2, 64)
    expected = x.bfloat16().float() @ torch.from_numpy(reference).t()
    torch.testing.assert_close(qkv(x), expected, rtol=2e-2, atol=5e-2)


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
    _, codes = quantized(32, 64, "Q4_0")
    assert attach_packed_weights(net, iter([("q_proj.weight", codes)]), max_tokens=8) == 0
    assert qkv.packed is None
