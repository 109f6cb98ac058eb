"""RMSNorm and RoPE through the CPU kernels (attention/csrc/layer_ops.c) against their torch
versions: RoPE bit for bit, RMSNorm within float rounding; and the cases the kernels leave
to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.attention import cpu_kernel
from tandem.models.layers import RMSNorm, apply_rotary

from helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


def torch_rotary(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_rotary_in_place_equals_torch_bit_for_bit(dtype, num_tokens):
    """Over Q and K heads viewed inside a fused QKV output (strided tokens), as the model
    calls it; 300 tokens × 12 heads takes the threaded path."""
    torch.manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, 15 * 64, dtype=dtype)
    qk = qkv[:, : 12 * 64].view(num_tokens, 12, 64)
    table = torch.randn(500, 64)
    cos, sin = table[torch.randint(0, 500, (num_tokens,))].unsqueeze(1).chunk(2, dim=-1)
    expected = torch_rotary(qk, cos, sin)
    v_before = qkv[:, 12 * 64 :].clone()
    got = apply_rotary(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(got, expected)
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # the values beside them untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 200])
def test_rms_norm_matches_torch(dtype, num_tokens):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576).to(dtype)
    x = torch.randn(num_tokens, 576, dtype=dtype) * 3
    expected = F.rms_norm(x.float(), (576,), norm.weight.float(), 1e-5).to(dtype)
    with torch.inference_mode():  # as the engine runs it (autograd needs the torch version)
        got = norm(x)
        assert cpu_kernel.rms_norm(x, norm.weight, 1e-5) is not None  # the kernel ran
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    )
    torch.testing.assert_close(got, expected, **tolerance)


def test_what_the_kernels_leave_to_torch():
    x = torch.randn(4, 64)
    assert cpu_kernel.rms_norm(x.t(), torch.ones(4), 1e-5) is None  # not contiguous
    assert cpu_kernel.rms_norm(x.half(), torch.ones(64).half(), 1e-5) is None  # fp16
    assert cpu_kernel.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5) is None
    heads = torch.randn(3, 4, 64)
    cos, sin = torch.randn(3, 1, 64).chunk(2, dim=-1)
    assert not cpu_kernel.rotary_(heads.transpose(0, 1), cos, sin)  # heads not contiguous
    assert not cpu_kernel.rotary_(heads, cos.double(), sin.double())
    broadcast_cos, broadcast_sin = torch.randn(1, 1, 64).chunk(2, dim=-1)
    assert not cpu_kernel.rotary_(heads, broadcast_cos, broadcast_sin)  # one row for 3 tokens
    weight = torch.ones(64, requires_grad=True)
    assert cpu_kernel.rms_norm(x, weight, 1e-5) is None  # autograd needs the torch version
    separate_sin = torch.randn(3, 1, 32)
    assert not cpu_kernel.rotary_(heads, cos, separate_sin)  # not one cos/sin row
    torch.testing.assert_close(
        apply_rotary(heads.half(), cos, sin), torch_rotary(heads.half(), cos, sin)
    )
