"""Test helpers that drive the model runner without a scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.attention.metadata import build_batch, forward_context
from tandem.worker.model_runner import ModelRunner


@dataclass
class Slice:
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int] = field(default_factory=list)


def all_token_logits(runner: ModelRunner, requests: list[Slice]) -> torch.Tensor:
    """Logits at every new token of the step (the runner itself only returns sampled rows)."""
    batch = build_batch(requests, runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(batch.attn_metadata):
        hidden = runner.model(batch.input_ids, batch.positions)
        return runner.model.compute_logits(hidden)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()
