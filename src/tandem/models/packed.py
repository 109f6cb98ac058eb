"""GGUF quantized weights kept packed and multiplied natively on CPU, for small (decode) steps.

A decode step is memory-bound: it reads every weight for a few tokens. Q4_0 / Q4_1 blocks hold
32 weights as 4-bit codes q with an fp16 scale d (and, for Q4_1, an fp16 minimum m):
w = d·(q − 8) and w = d·q + m. torch's CPU int4 weight-only matmul computes
w = (q − 8)·scale + zero per 32-weight group, so both map onto it exactly (scale = d, zero = 0
or m + 8d), with scales, zeros and activations in bfloat16 (its fast path). A Q8_0 block
(w = d·q, q an int8) is two such groups: q = 16·hi + lo with hi in [−8, 7] and lo in [0, 15],
so w = 16d·hi + d·lo, one int4 matrix twice as wide multiplied by the input twice over
(1.25 bytes a weight instead of bf16's 2). The dense weights stay beside them for
prefill-sized steps, where the packed kernel loses to a dense GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP_SIZE = 32  # weights per Q4_0 / Q4_1 block, and the int4 kernel's group size
PACKED_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 d (+ fp16 m), then the codes
_INT4_OFFSET = 8  # the kernel's (q - 8)


@dataclass
class Int4Codes:
    """One weight matrix `[out_features, in_features]` as codes and per-group affine terms,
    before packing: shards (Q, K, V) are concatenated over output rows in this form."""

    codes: np.ndarray  # uint8 [N, K * input_copies], values 0..15
    scales: np.ndarray  # float32 [N, K * input_copies / 32]
    zeros: np.ndarray  # float32 [N, K * input_copies / 32]: w = (q - 8) * scale + zero
    input_copies: int = 1  # 2 for Q8_0: the sum of two int4 matrices over the same input

    @staticmethod
    def cat(parts: list[Int4Codes]) -> Int4Codes | None:
        """Shards concatenated over output rows; None if they differ in kind (Q4 and Q8_0)."""
        if len({p.input_copies for p in parts}) != 1:
            return None
        return Int4Codes(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scales for p in parts]),
            np.concatenate([p.zeros for p in parts]),
            parts[0].input_copies,
        )

    def permute_rows(self, permute) -> Int4Codes:
        """The same row permutation applied to codes and affine terms (llama.cpp's Q/K)."""
        return Int4Codes(
            permute(self.codes), permute(self.scales), permute(self.zeros), self.input_copies
        )

    def dequantize(self) -> np.ndarray:
        """float32 weights, for tests against gguf's own dequantization."""
        scales = np.repeat(self.scales, GROUP_SIZE, axis=1)
        zeros = np.repeat(self.zeros, GROUP_SIZE, axis=1)
        parts = (self.codes.astype(np.float32) - _INT4_OFFSET) * scales + zeros
        return sum(np.split(parts, self.input_copies, axis=1))


def unpack_blocks(raw: np.ndarray, quant_type: str, shape: tuple[int, int]) -> Int4Codes:
    """Raw GGUF Q4_0 / Q4_1 / Q8_0 bytes of a `[N, K]` matrix to codes and affine terms."""
    rows, cols = shape
    groups = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(raw).reshape(rows, groups, _BLOCK_BYTES[quant_type])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if quant_type == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols).astype(np.int16)
        high, low = np.divmod(q, 16)  # q = 16 * high + low, high in [-8, 7], low in [0, 15]
        return Int4Codes(
            np.concatenate([high + _INT4_OFFSET, low], axis=1).astype(np.uint8),
            np.concatenate([16 * d, d], axis=1),
            np.concatenate([np.zeros_like(d), _INT4_OFFSET * d], axis=1),
            input_copies=2,
        )
    if quant_type == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + _INT4_OFFSET * d
        packed_codes = blocks[..., 4:]
    else:
        zeros = np.zeros_like(d)
        packed_codes = blocks[..., 2:]
    # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high one.
    codes = np.concatenate([packed_codes & 0x0F, packed_codes >> 4], axis=-1)
    return Int4Codes(codes.reshape(rows, cols), d, zeros)


@dataclass
class PackedWeight:
    """A linear layer's weight in the int4 kernel's layout; used for steps of at most
    `max_tokens` rows."""

    weight: torch.Tensor  # uint8, the kernel's packed layout
    scales_zeros: torch.Tensor  # bfloat16 [K * input_copies / 32, N, 2]
    max_tokens: int
    input_copies: int = 1

    @classmethod
    def from_codes(cls, codes: Int4Codes, max_tokens: int) -> PackedWeight:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes.codes.astype(np.int32)), 1
        )
        scales_zeros = torch.stack(
            [torch.from_numpy(codes.scales).t(), torch.from_numpy(codes.zeros).t()], dim=-1
        )
        scales_zeros = scales_zeros.to(torch.bfloat16).contiguous()
        return cls(weight, scales_zeros, max_tokens, codes.input_copies)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales_zeros.nbytes

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        inputs = x.to(torch.bfloat16)
        if self.input_copies > 1:
            inputs = torch.cat([inputs] * self.input_copies, dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            inputs, self.weight, GROUP_SIZE, self.scales_zeros
        ).to(x.dtype)
        return out if bias is None else out + bias
