"""Tiny random-weight HF models, written by transformers: the reference checkpoints of the tests
(in a module of its own, not conftest.py, so test files in any folder can import it)."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=320,
    intermediate_size=160,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def make_hf_model(config_class: str, kwargs: dict, seed: int = 0) -> torch.nn.Module:
    """A random HF model whose weights are large enough that logits are far from uniform."""
    import transformers

    config = getattr(transformers, config_class)(**COMMON, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    return model.eval()
