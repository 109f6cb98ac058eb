"""Model configuration, read from HF `config.json` dicts (transformers 4 and 5) or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Architecture name (as in HF `architectures`) -> family flags the model code switches on.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias_always": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias_always": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias_always": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias_always": False, "qk_norm": True},
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes something tandem cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The dtype the checkpoint was saved in ("bfloat16", "float32", ...): `torch_dtype` in
    # transformers 4 configs, `dtype` in 5; None when it says nothing (GGUF files).
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def parse_rope(hf: dict[str, Any]) -> RopeConfig:
    """RoPE settings: transformers 5 nests them in `rope_parameters`, transformers 4 uses
    top-level `rope_theta` plus `rope_scaling`. Both are read; theta defaults to 10000 only
    when neither format names it (as transformers itself does)."""
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a transformers `config.json` dict."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise UnsupportedModelError(
            "config.json names no architecture (key 'architectures'); supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    arch = architectures[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    attention_bias = bool(hf.get("attention_bias", False))
    sliding_window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family["qkv_bias_always"] or attention_bias,
        o_bias=attention_bias and not family["qkv_bias_always"],
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family["qk_norm"],
        sliding_window=int(sliding_window) if sliding_window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        torch_dtype=_dtype_name(hf.get("torch_dtype") or hf.get("dtype")),
    )


def _dtype_name(value: Any) -> str | None:
    """Both "torch.bfloat16" (some configs) and "bfloat16" become "bfloat16"."""
    return value.removeprefix("torch.") if isinstance(value, str) else None
