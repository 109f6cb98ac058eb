"""GGUF quantized weights kept packed and multiplied natively on CPU, for small (decode) steps.

A decode step is memory-bound: it reads every weight for a few tokens. Q4_0 / Q4_1 / Q8_0
blocks hold 32 weights as 4-bit codes q with an fp16 scale d (and, for Q4_1, an fp16 minimum
m): w = d·(q − 8), d·q + m, or d·q with q an int8. The dense weights stay beside them for
prefill-sized steps, where a packed kernel loses to a dense GEMM.

Two kernels multiply them. The C one (attention/csrc/packed_matmul.c, built by cpu_kernel.py)
takes the blocks' codes and fp16 scales regrouped 16 output rows side by side (`kernel_layout`)
and widens each weight to fp32 exactly, so its results equal the dequantized fp32 matrix's up
to the order of the sums. From `int8_min_tokens` rows up (where the CPU format probe found it
faster) it quantizes the activations to int8 per 8 columns (scales in whole units per 32)
instead and sums integer products (csrc/packed_matmul_int8.c, llama.cpp's scheme with finer
activation scales): a few times fewer instructions per weight and token, at the activations'
rounding. Where it cannot be built, torch's CPU int4 weight-only matmul runs instead: it
computes w = (q − 8)·scale + zero per 32-weight group, so Q4_0 and Q4_1 map onto it exactly
(scale = d, zero = 0 or m + 8d), with scales, zeros and activations in bfloat16 (its fast
path); a Q8_0 block (q = 16·hi + lo with hi in [−8, 7], lo in [0, 15]) is two such groups, w =
16d·hi + d·lo, one int4 matrix twice as wide multiplied by the input twice over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.attention import cpu_kernel

GROUP_SIZE = 32  # weights per Q4_0 / Q4_1 block, and the int4 kernel's group size
PACKED_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 d (+ fp16 m), then the codes
_INT4_OFFSET = 8  # the kernel's (q - 8)
KERNEL_LANES = 16  # output rows side by side in the C kernel's layout


def _fp16(field: np.ndarray) -> np.ndarray:
    """A block field of 2 bytes ([..., 2] uint8) as its fp16 values ([...])."""
    return field.copy().view(np.float16)[..., 0]


@dataclass
class QuantBlocks:
    """One `[out_features, in_features]` matrix as the GGUF file's blocks, a row of blocks per
    output row; fused shards (Q, K, V) are concatenated over rows in this form."""

    data: np.ndarray  # uint8 [out_features, in_features / 32 * block bytes]
    quant_type: str  # one of PACKED_QUANT_TYPES
    in_features: int

    @staticmethod
    def cat(parts: list[QuantBlocks]) -> QuantBlocks | None:
        """Shards concatenated over output rows (Q4_0 ones beside Q4_1 ones as Q4_1 blocks);
        None where they differ otherwise (a Q8_0 shard beside a Q4 one)."""
        if {p.quant_type for p in parts} == {"Q4_0", "Q4_1"}:
            parts = [p.as_q4_1() if p.quant_type == "Q4_0" else p for p in parts]
        if len({(p.quant_type, p.in_features) for p in parts}) != 1:
            return None
        return QuantBlocks(
            np.concatenate([p.data for p in parts]), parts[0].quant_type, parts[0].in_features
        )

    def as_q4_1(self) -> QuantBlocks:
        """Q4_0 blocks (d, codes: w = d·(q − 8)) as Q4_1 ones (d, m = −8d, codes); exact: 8d
        is d with its exponent moved by 3."""
        rows = len(self.data)
        blocks = self.data.reshape(rows, -1, _BLOCK_BYTES["Q4_0"])
        m = (-8 * _fp16(blocks[..., 0:2]))[..., None].view(np.uint8)
        q4_1 = np.concatenate([blocks[..., 0:2], m, blocks[..., 2:]], axis=-1)
        return QuantBlocks(q4_1.reshape(rows, -1), "Q4_1", self.in_features)

    def permute_rows(self, permute) -> QuantBlocks:
        """A row permutation (llama.cpp's Q/K order): each row's blocks move whole."""
        return QuantBlocks(permute(self.data), self.quant_type, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix, the same products as gguf's reader forms (bit for bit), in torch's
        threaded ops: gguf's numpy code, a few rows at a time, took 3.2 s of every start of the
        embedded model on a slow CPU."""
        rows = len(self.data)
        blocks = torch.from_numpy(np.array(self.data)).view(  # a copy: the file's map is read-only
            rows, -1, _BLOCK_BYTES[self.quant_type]
        )
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.quant_type == "Q8_0":
            weights = blocks[..., 2:].contiguous().view(torch.int8).float() * d
        else:  # byte j: weight j in its low nibble, weight j + 16 in its high one
            codes = blocks[..., -(GROUP_SIZE // 2) :]
            q = torch.cat([codes & 15, codes >> 4], dim=-1)
            if self.quant_type == "Q4_0":
                weights = (q.to(torch.int8) - _INT4_OFFSET).float() * d
            else:
                weights = q.float() * d + blocks[..., 2:4].contiguous().view(torch.float16).float()
        return weights.reshape(rows, self.in_features)

    def int4_codes(self) -> Int4Codes:
        return unpack_blocks(self.data, self.quant_type, (len(self.data), self.in_features))

    def kernel_layout(self) -> tuple[np.ndarray, np.ndarray]:
        """Codes and fp16 scales as csrc/packed_matmul.c reads them: output rows in groups of
        16 (zero-padded), each group's 32-column blocks in turn, the 16 rows side by side.
        Q4_1 or Q8_0 blocks (Q4_0 ones go through as_q4_1)."""
        assert self.quant_type in cpu_kernel.QUANT_TYPE_IDS
        rows = len(self.data)
        row_groups = -(-rows // KERNEL_LANES)
        blocks = np.zeros(
            (
                row_groups * KERNEL_LANES,
                self.in_features // GROUP_SIZE,
                _BLOCK_BYTES[self.quant_type],
            ),
            dtype=np.uint8,
        )
        blocks[:rows] = self.data.reshape(rows, *blocks.shape[1:])
        d = _fp16(blocks[..., 0:2])
        if self.quant_type == "Q8_0":  # columns by fours: [rows, groups, 8, 4]
            codes, scales = blocks[..., 2:].reshape(*blocks.shape[:2], 8, 4), d[..., None]
        else:
            codes, scales = blocks[..., 4:], np.stack([d, _fp16(blocks[..., 2:4])], -1)

        # [groups·16 rows, column groups, bytes | scales] -> [groups, column groups, ·, 16 rows]
        def lanes_last(a: np.ndarray) -> np.ndarray:
            grouped = a.reshape(row_groups, KERNEL_LANES, *a.shape[1:])
            order = (0, 2, 3, 1, *range(4, grouped.ndim))
            return np.ascontiguousarray(grouped.transpose(order))

        return lanes_last(codes), lanes_last(scales)


@dataclass
class Int4Codes:
    """One weight matrix `[out_features, in_features]` as codes and per-group affine terms:
    torch's int4 op's operands before packing."""

    codes: np.ndarray  # uint8 [N, K * input_copies], values 0..15
    scales: np.ndarray  # float32 [N, K * input_copies / 32]
    zeros: np.ndarray  # float32 [N, K * input_copies / 32]: w = (q - 8) * scale + zero
    input_copies: int = 1  # 2 for Q8_0: the sum of two int4 matrices over the same input

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
    d = _fp16(blocks[..., 0:2]).astype(np.float32)
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
        m = _fp16(blocks[..., 2:4]).astype(np.float32)
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
    """A linear layer's weight kept packed, used for steps of at most `max_tokens` rows: the
    file's codes and scales in the C kernel's layout, or (where it is not built) torch's int4
    layout. Steps of at least `int8_min_tokens` rows (0: none) multiply int8 activations."""

    max_tokens: int
    in_features: int
    codes: torch.Tensor | None = None  # uint8, QuantBlocks.kernel_layout (the C kernel)
    scales: torch.Tensor | None = None  # fp16 bits (int16), the same
    out_features: int = 0
    quant_type: str = ""
    int4_weight: torch.Tensor | None = None  # uint8, torch's packed int4 layout
    scales_zeros: torch.Tensor | None = None  # bfloat16 [K * input_copies / 32, N, 2]
    input_copies: int = 1
    int8_min_tokens: int = 0  # the C kernel only

    @classmethod
    def from_blocks(
        cls,
        blocks: QuantBlocks,
        max_tokens: int,
        use_kernel: bool = True,
        int8_min_tokens: int = 0,
    ) -> PackedWeight:
        if use_kernel and cpu_kernel.load_library() is not None:
            if blocks.quant_type == "Q4_0":
                blocks = blocks.as_q4_1()
            codes, scales = blocks.kernel_layout()
            return cls(
                max_tokens,
                blocks.in_features,
                codes=torch.from_numpy(codes),
                scales=torch.from_numpy(scales.view(np.int16)),
                out_features=len(blocks.data),
                quant_type=blocks.quant_type,
                int8_min_tokens=int8_min_tokens,
            )
        codes = blocks.int4_codes()
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes.codes.astype(np.int32)), 1
        )
        scales_zeros = torch.stack(
            [torch.from_numpy(codes.scales).t(), torch.from_numpy(codes.zeros).t()], dim=-1
        )
        return cls(
            max_tokens,
            blocks.in_features,
            int4_weight=weight,
            scales_zeros=scales_zeros.to(torch.bfloat16).contiguous(),
            input_copies=codes.input_copies,
        )

    @property
    def nbytes(self) -> int:
        if self.codes is not None:
            return self.codes.nbytes + self.scales.nbytes
        return self.int4_weight.nbytes + self.scales_zeros.nbytes

    def _check_width(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"a packed matmul of {self.in_features} inputs got rows of {x.shape[-1]}"
            )

    @property
    def one_row_int8(self) -> bool:
        """A one-row step multiplies int8 activations."""
        return 0 < self.int8_min_tokens <= 1

    def matmul_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For one fp32 row without a bias: `matmul`'s product and its first argmax, from one
        pass of the C kernel; None where that kernel would not multiply it."""
        if self.codes is None or x.shape[0] != 1:
            return None
        self._check_width(x)
        return cpu_kernel.packed_matmul_argmax(
            self.codes, self.scales, self.quant_type, self.out_features, x,
            int8_activations=self.one_row_int8,
        )  # fmt: skip

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._check_width(x)
        if self.codes is not None:
            int8 = 0 < self.int8_min_tokens <= x.shape[0]
            out = cpu_kernel.packed_matmul(
                self.codes, self.scales, self.quant_type, self.out_features, x, int8
            )
        else:
            inputs = x.to(torch.bfloat16)
            if self.input_copies > 1:
                inputs = torch.cat([inputs] * self.input_copies, dim=1)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                inputs, self.int4_weight, GROUP_SIZE, self.scales_zeros
            ).to(x.dtype)
        return out if bias is None else out + bias
