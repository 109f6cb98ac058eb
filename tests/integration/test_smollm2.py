"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against HF transformers' own GGUF loader."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.tokenizer import load_tokenizer
from tandem.worker.model_runner import ModelRunner, RunnerConfig

from helpers import Slice, all_token_logits, hf_logits, relative_error

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about paged attention.",
    "List three prime numbers greater than 100 and explain why each is prime.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(RunnerConfig(model="default", num_kv_blocks=64))


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_config_read_from_gguf_metadata(runner):
    config = runner.model_config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (
        30,
        576,
        9,
    )
    assert config.num_key_value_heads == 3
    assert config.rope.theta == 100000.0
    assert config.tie_word_embeddings


def test_prompt_logits_match_hf(runner, smollm2_hf, tokenizer):
    prompts = [_chat_ids(tokenizer, text) for text in PROMPTS]
    slices, next_block = [], 0
    for ids in prompts:
        num_blocks = -(-len(ids) // runner.block_size)
        slices.append(Slice(ids, 0, len(ids), list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    logits = all_token_logits(runner, slices)
    offset = 0
    for ids in prompts:
        expected = hf_logits(smollm2_hf, ids)
        assert relative_error(logits[offset : offset + len(ids)], expected) <= 1e-4
        offset += len(ids)


def test_greedy_decode_through_cache_matches_hf_generate(runner, smollm2_hf, tokenizer):
    ids = _chat_ids(tokenizer, PROMPTS[0])
    with torch.inference_mode():
        reference = smollm2_hf.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )[0, len(ids) :].tolist()
    request = Slice(list(ids), 0, len(ids), list(range(8)))
    generated = []
    for _ in range(24):
        token = int(runner.execute([request])[0].argmax())
        generated.append(token)
        request.num_computed_tokens += request.num_new_tokens
        request.num_new_tokens = 1
        request.token_ids.append(token)
    assert generated == reference
    assert "Paris" in tokenizer.decode(generated)
