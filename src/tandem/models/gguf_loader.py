"""GGUF files: config from the metadata, tensors renamed to HF names and dequantized.

llama.cpp stores Llama Q/K projections with rows permuted for its interleaved RoPE; they are
permuted back here so the rotate-half model code is the same for both formats.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.config import ModelConfig, UnsupportedModelError, model_config_from_hf
from tandem.models.gguf_cache import cached_json
from tandem.models.packed import PACKED_QUANT_TYPES, QuantBlocks

# GGUF general.architecture -> HF architecture name, and whether Q/K rows are permuted.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@functools.lru_cache(maxsize=2)
def _reader(path: Path) -> Any:
    """Parsing the metadata (the vocabulary above all) takes seconds: do it once per file."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


@dataclass(frozen=True, eq=False)
class GgufTensor:
    name: str
    type_name: str  # gguf.GGMLQuantizationType's name
    shape: tuple[int, ...]  # rows first, as torch has it (GGUF lists the dimensions reversed)
    data: np.ndarray  # the file's bytes of it, as GGUFReader views them (read-only)

    def blocks(self) -> QuantBlocks | None:
        """A Q4_0 / Q4_1 / Q8_0 matrix as its blocks (models/packed.py); None for the rest."""
        if self.type_name not in PACKED_QUANT_TYPES or len(self.shape) != 2:
            return None
        rows, cols = self.shape
        return QuantBlocks(self.data.view(np.uint8).reshape(rows, -1), self.type_name, cols)


@functools.lru_cache(maxsize=2)
def _tensors(path: Path) -> tuple[str, list[GgufTensor]]:
    """The file's architecture and tensors. GGUFReader parses every metadata field to list them
    (the vocabulary above all: 5 s on a slow 2-core machine), so their places in the file are
    kept in the cache, and a later start views them there without the reader."""
    index = cached_json(path, "tensors", lambda: _tensor_index(path))
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = [
        GgufTensor(
            entry["name"],
            entry["type"],
            tuple(entry["shape"]),
            file[entry["offset"] : entry["offset"] + entry["bytes"]]
            .view(entry["dtype"])
            .reshape(entry["data_shape"]),
        )
        for entry in index["tensors"]
    ]
    return index["architecture"], tensors


def _tensor_index(path: Path) -> dict[str, Any]:
    reader = _reader(path)
    return {
        "architecture": _field(reader, "general.architecture"),
        "tensors": [
            {
                "name": tensor.name,
                "type": tensor.tensor_type.name,
                "shape": [int(d) for d in reversed(tensor.shape)],
                "offset": int(tensor.data_offset),
                "bytes": int(tensor.data.nbytes),
                "dtype": tensor.data.dtype.str,
                "data_shape": list(tensor.data.shape),
            }
            for tensor in reader.tensors
        ],
    }


def _hf_architecture(arch: str) -> tuple[str, str, bool]:
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(GGUF_ARCHITECTURES)
        )
    return (arch, *GGUF_ARCHITECTURES[arch])


def gguf_model_config(path: Path) -> ModelConfig:
    return model_config_from_hf(cached_json(path, "config", lambda: _hf_config(path)))


def gguf_has_packable_weights(path: Path) -> bool:
    """Whether any matrix of the file is Q4_0 / Q4_1 / Q8_0 (kept packed under dtype="auto")."""
    return any(tensor.type_name in PACKED_QUANT_TYPES for tensor in _tensors(path)[1])


def _hf_config(path: Path) -> dict[str, Any]:
    """The metadata as an HF config.json would say it."""
    reader = _reader(path)
    arch, hf_arch, _ = _hf_architecture(_field(reader, "general.architecture"))
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise UnsupportedModelError(
            "this GGUF stores llama3 RoPE scaling as per-frequency factors (rope_freqs), which "
            "tandem does not read yet: load the model's HF folder instead"
        )
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(
            _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
        ),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        hf["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
        }
    return hf


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in tandem")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleave of Q/K rows (weights or biases)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope_row_heads(name: str, config: ModelConfig, permuted_qk: bool) -> int | None:
    """Heads whose rows llama.cpp interleaved in this tensor (None: rows as HF has them)."""
    if permuted_qk and ".q_proj." in name:
        return config.num_attention_heads
    if permuted_qk and ".k_proj." in name:
        return config.num_key_value_heads
    return None


def iter_gguf_packable(path: Path, config: ModelConfig) -> Iterator[tuple[str, QuantBlocks]]:
    """The Q4_0 / Q4_1 / Q8_0 matrices of the file, by HF name, as their blocks
    (models/packed.py), Q and K rows in HF's order."""
    architecture, tensors = _tensors(path)
    _, _, permuted_qk = _hf_architecture(architecture)
    for tensor in tensors:
        blocks = tensor.blocks()
        if blocks is None:
            continue
        name = hf_tensor_name(tensor.name)
        heads = _rope_row_heads(name, config, permuted_qk)
        if heads is not None:
            blocks = blocks.permute_rows(lambda rows, h=heads: unpermute_rope_rows(rows, h))
        yield name, blocks


def iter_gguf_tensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    architecture, tensors = _tensors(path)
    _, _, permuted_qk = _hf_architecture(architecture)
    for tensor in tensors:
        if tensor.type_name not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {tensor.name!r} is stored as {tensor.type_name}, which tandem "
                f"cannot dequantize; supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
            )
        name = hf_tensor_name(tensor.name)
        blocks = tensor.blocks()
        if blocks is not None:
            array = blocks.dequantize().numpy()
        else:  # a copy: the memmap is read-only
            array = np.array(dequantize(tensor.data, GGMLQuantizationType[tensor.type_name]))
            array = array.reshape(tensor.shape)
        heads = _rope_row_heads(name, config, permuted_qk)
        if heads is not None:
            array = unpermute_rope_rows(array, heads)
        yield name, torch.from_numpy(array)
