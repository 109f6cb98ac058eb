"""Shared fixtures: tiny random-weight checkpoints of every family, written by transformers."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_models import make_hf_model


@pytest.fixture(scope="session", autouse=True)
def _tandem_cache_dir(tmp_path_factory) -> None:
    """GGUF metadata caches of this session (its temporary GGUF files above all) go to a
    folder of its own, not the user's ~/.cache; server processes inherit it."""
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("tandem-cache"))


@pytest.fixture(scope="session")
def older_x86_kernels(tmp_path_factory) -> Callable[[str], ctypes.CDLL]:
    """`build(march)`: the kernel library built for an older x86 level, once per session
    (a build takes ~6 s on two cores; four test modules check their kernels in it)."""
    from helpers import kernels_built_for  # builds the native library: only where wanted

    built: dict[str, ctypes.CDLL] = {}

    def build(march: str) -> ctypes.CDLL:
        if march not in built:
            built[march] = kernels_built_for(march, tmp_path_factory.mktemp(march))
        return built[march]

    return build


# (name, HF config class, kwargs): odd shapes on purpose (GQA 1/3/6, head_dim 32/64/128,
# biases, q/k norm, tied embeddings, llama3 RoPE scaling, a non-default theta).
FAMILY_CONFIGS: list[tuple[str, str, dict]] = [
    (
        "llama-mha-hd32-tied-bias",
        "LlamaConfig",
        dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_theta=10000.0,
        ),
    ),
    (
        "llama3-gqa3-hd64-ropescaling",
        "LlamaConfig",
        dict(
            hidden_size=192,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    (
        "mistral-gqa6-hd32",
        "MistralConfig",
        dict(
            hidden_size=192,
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1000000.0,
            sliding_window=4096,
        ),
    ),
    (
        "qwen2-qkvbias-gqa3-hd64",
        "Qwen2Config",
        dict(
            hidden_size=192,
            num_attention_heads=3,
            num_key_value_heads=1,
            head_dim=64,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
    ),
    (
        "qwen3-qknorm-gqa2-hd128",
        "Qwen3Config",
        dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
]


@pytest.fixture(scope="session", params=FAMILY_CONFIGS, ids=[c[0] for c in FAMILY_CONFIGS])
def family_checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """(folder written by save_pretrained, the HF model) for each family."""
    name, config_class, kwargs = request.param
    model = make_hf_model(config_class, kwargs)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A small GQA Llama with tied embeddings, for engine tests that need speed, not variety."""
    model = make_hf_model(
        "LlamaConfig",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             tie_word_embeddings=True),
        seed=3,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    return folder, model
