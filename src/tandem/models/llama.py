"""The Llama-style decoder over a flattened `[T, hidden]` batch.

One implementation covers Llama 2/3, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm) and
SmolLM2; the differences are flags in `ModelConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.attention import cpu_kernel, torch_backend
from tandem.attention.metadata import get_attn_metadata
from tandem.config import ModelConfig
from tandem.models.layers import (
    Embedding,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    silu_and_mul,
)
from tandem.models.packed import PackedWeight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
            config.qkv_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        # [2, num_blocks, block_size, num_kv_heads, head_dim], bound by the model runner, with
        # the attention backend that reads it (attention/backends.py).
        self.kv_cache = torch.empty(0)
        self.paged_attention: Callable[..., torch.Tensor] = torch_backend.paged_attention

    def project(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of the step's tokens, RoPE applied."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_size = self.q_size + self.kv_size
        # Q and K heads side by side, so RoPE runs once over both.
        if self.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, -1))
            k = self.k_norm(qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, -1))
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v in the paged cache and attend over each request's context: the one part
        of a layer that reads the step's metadata, so it stays outside compiled regions."""
        return self.paged_attention(q, k, v, self.kv_cache, get_attn_metadata(), self.scale)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": size, "up": size}, config.mlp_bias
        )
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.attention_inputs(rope, hidden)
        return self.attention_outputs(hidden, self.self_attn.attend(q, k, v))

    # The two halves around attention: what CausalLM.compile_layers compiles.
    def attention_inputs(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(rope, self.input_layernorm(hidden))

    def attention_outputs(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn.o_proj(attended.reshape(attended.shape[0], -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        for layer in self.layers:
            hidden = layer(rope, hidden)
        return self.norm(hidden)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns hidden states; logits are computed only for the
    rows that get sampled (the head is the largest matmul of a prefill)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The head's weight kept packed (models/packed.py), for a few sampled rows at a time.
        self.lm_head_packed: PackedWeight | None = None
        self.dense_head_max_tokens = 0  # see use_dense_kernel

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @property
    def lm_head_checkpoint_name(self) -> str:
        """The checkpoint tensor (without ".weight") the head multiplies by."""
        return "model.embed_tokens" if self.config.tie_word_embeddings else "lm_head"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = self.lm_head_packed
        if packed is not None and hidden.shape[0] <= packed.max_tokens:
            return packed.matmul(hidden.float())  # the kernel's fp32 sums, not rounded to bf16
        if hidden.shape[0] <= self.dense_head_max_tokens:
            logits = cpu_kernel.dense_matmul(hidden, self.lm_head_weight)
            if logits is not None:
                return logits
        return F.linear(hidden, self.lm_head_weight).float()

    def compute_logits_and_argmax(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`compute_logits`, and each row's first argmax where the LM head's kernel finds it
        as it writes the logits (one row, packed weights); else None."""
        packed = self.lm_head_packed
        if packed is not None and hidden.shape[0] <= packed.max_tokens:
            both = packed.matmul_argmax(hidden.float().contiguous())
            if both is not None:
                return both
        return self.compute_logits(hidden), None

    def use_dense_kernel(self, max_tokens: int) -> None:
        """Steps of at most `max_tokens` rows multiply the fp32 weights (layers and head) in
        the C kernel (csrc/dense_matmul.c); 0: torch's GEMM for every step."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.dense_max_tokens = max_tokens
        self.dense_head_max_tokens = max_tokens

    def compile_layers(self, min_tokens: int = 1) -> None:
        """torch.compile each layer's two halves around attention (dynamic token counts), for
        steps of at least `min_tokens` tokens: RMSNorm, RoPE, SiLU·mul and the residual adds
        fuse into a few kernels instead of ~25 eager ops per layer. The layers share one code
        object, so they share the compiled graphs. Smaller steps (those that multiply packed
        weights or take the dense kernel) stay eager: compiled, they measured no faster, and
        the C calls cannot be traced."""
        for layer in self.model.layers:
            layer.attention_inputs = _compiled_from(layer.attention_inputs, min_tokens)
            layer.attention_outputs = _compiled_from(layer.attention_outputs, min_tokens)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]


def _compiled_from(method: Callable[..., Any], min_tokens: int) -> Callable[..., Any]:
    """`method` torch.compiled for calls whose last argument (a `[T, ...]` tensor) has at least
    `min_tokens` rows; eager below that."""
    compiled = torch.compile(method, dynamic=True)

    def run(*args: Any) -> Any:
        return (compiled if args[-1].shape[0] >= min_tokens else method)(*args)

    return run
