"""Building blocks shared by the decoder families: norms, rotary embedding, fused linears."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import cpu_kernel
from tandem.config import RopeConfig
from tandem.models.packed import PackedWeight


class CheckpointMismatchError(ValueError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape."""


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if loaded.shape != param.shape:
        raise CheckpointMismatchError(
            f"tensor {name!r} has shape {tuple(loaded.shape)}, the model expects "
            f"{tuple(param.shape)}; the checkpoint does not match its config.json"
        )
    param.data.copy_(loaded)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernel.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Embedding(nn.Module):
    """A token embedding table, filled by the loader. Not nn.Embedding: its random init runs
    even on the meta device, where `normal_` imports torch._dynamo (2.8 s of every start on a
    slow CPU, for a table the checkpoint overwrites)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class Linear(nn.Module):
    """x·Wᵀ + b. The weight may also be kept packed (models/packed.py): steps of at most
    `packed.max_tokens` rows (decodes) multiply that instead, reading a fraction of the bytes.
    Steps of at most `dense_max_tokens` rows multiply an fp32 weight through the C kernel
    (csrc/dense_matmul.c), which streams it where torch's GEMM does not."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: PackedWeight | None = None
        self.dense_max_tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None and x.shape[0] <= packed.max_tokens:
            return packed.matmul(x, self.bias)
        if x.shape[0] <= self.dense_max_tokens:
            out = cpu_kernel.dense_matmul(x, self.weight, self.bias)
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several projections of the same input (QKV, gate/up), fused at load:
    each checkpoint tensor is copied into its row range by `load_shard`."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def load_shard(
        self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str, name: str
    ) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data[offset : offset + size], loaded, name)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, with linear or llama3 (wavelength-banded) scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over flattened tokens, with a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)

    def build_table(self) -> None:
        """Fill the table (called after the model is materialised on its device)."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin = table.to(self.cos_sin.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, head_dim / 2]` for the step's positions (looked up once per step,
        shared by every layer)."""
        return self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` [T, heads, head_dim], computed in float32; on CPU in place, in
    one kernel call (cpu_kernel.rotary_, the same arithmetic), elsewhere a new tensor."""
    if cpu_kernel.rotary_(x, cos, sin):
        return x
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
