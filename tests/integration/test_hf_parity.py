"""Logits equal HF transformers' on the same weights (fp32, CPU), for every family."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tandem.worker.model_runner import ModelRunner, RunnerConfig

from helpers import Slice, all_token_logits, hf_logits, relative_error

TOLERANCE = 1e-4


def _runner(
    folder, block_size: int = 16, num_kv_blocks: int = 64, dense_max_tokens: int = 0
) -> ModelRunner:
    return ModelRunner(
        RunnerConfig(model=folder, block_size=block_size, num_kv_blocks=num_kv_blocks,
                     dense_max_tokens=dense_max_tokens)
    )  # fmt: skip


# Steps of up to 64 tokens multiplied by the C dense kernel (csrc/dense_matmul.c), or none.
DENSE_KERNEL = pytest.mark.parametrize("dense_max_tokens", [0, 64], ids=["torch-gemm", "kernel"])


def _prompts(vocab_size: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def _shuffled_blocks(num_blocks: int, seed: int = 2) -> list[int]:
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    return blocks


@DENSE_KERNEL
def test_prefill_logits_match_hf(family_checkpoint, dense_max_tokens):
    """Several prompts in one batch, each over non-contiguous blocks: every position matches."""
    folder, hf_model = family_checkpoint
    runner = _runner(folder, block_size=4, dense_max_tokens=dense_max_tokens)
    prompts = _prompts(hf_model.config.vocab_size, [7, 19, 33])
    free = _shuffled_blocks(runner.num_kv_blocks)
    slices = []
    for prompt in prompts:
        blocks = [free.pop() for _ in range(-(-len(prompt) // 4))]
        slices.append(Slice(prompt, 0, len(prompt), blocks))
    logits = all_token_logits(runner, slices)
    offset = 0
    for prompt in prompts:
        expected = hf_logits(hf_model, prompt)
        assert relative_error(logits[offset : offset + len(prompt)], expected) <= TOLERANCE
        offset += len(prompt)


def test_mixed_chunks_and_decodes_equal_one_shot(family_checkpoint):
    """One step mixing a request's third prefill chunk, another's first chunk and several
    decode tokens gives each request the logits of running it alone in one shot."""
    folder, hf_model = family_checkpoint
    block_size = 16
    runner = _runner(folder, block_size=block_size, num_kv_blocks=64)
    long_a, long_b, *decodes = _prompts(hf_model.config.vocab_size, [45, 30, 9, 17, 26, 40])
    free = _shuffled_blocks(runner.num_kv_blocks)

    def blocks_for(num_tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-num_tokens // block_size))]

    a = Slice(long_a, 0, 0, blocks_for(len(long_a)))
    b = Slice(long_b, 0, 12, blocks_for(len(long_b)))
    decode_slices = [Slice(p, 0, len(p) - 1, blocks_for(len(p))) for p in decodes]
    # Earlier steps: A's first two chunks (alone), then the decoders' prompts but their last token.
    for computed, chunk in [(0, 16), (16, 14)]:
        a.num_computed_tokens, a.num_new_tokens = computed, chunk
        runner.execute([a])
    runner.execute(decode_slices)
    a.num_computed_tokens, a.num_new_tokens = 30, 15
    for d in decode_slices:
        d.num_computed_tokens, d.num_new_tokens = len(d.token_ids) - 1, 1
    step = [decode_slices[0], a, decode_slices[1], b, *decode_slices[2:]]
    logits = runner.execute(step)

    expected_rows = [
        hf_logits(hf_model, s.token_ids[: s.num_computed_tokens + s.num_new_tokens])[-1]
        for s in step
    ]
    for row, expected in zip(logits, expected_rows, strict=True):
        assert relative_error(row, expected) <= TOLERANCE


@DENSE_KERNEL
def test_decode_steps_match_hf(family_checkpoint, dense_max_tokens):
    """Greedy decode token by token through the cache matches HF on the grown sequence."""
    folder, hf_model = family_checkpoint
    runner = _runner(folder, block_size=8, dense_max_tokens=dense_max_tokens)
    (prompt,) = _prompts(hf_model.config.vocab_size, [11], seed=5)
    request = Slice(list(prompt), 0, len(prompt), list(range(8)))
    for _ in range(6):
        logits = runner.execute([request])[0]
        expected = hf_logits(hf_model, request.token_ids)[-1]
        assert relative_error(logits, expected) <= TOLERANCE
        request.num_computed_tokens += request.num_new_tokens
        request.num_new_tokens = 1
        request.token_ids.append(int(expected.argmax()))


def _write_transformers4_config(folder) -> None:
    """Rewrite config.json the way transformers 4 wrote it: top-level rope_theta plus an
    optional rope_scaling dict, no rope_parameters."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(config))


def test_transformers4_config_format(family_checkpoint, tmp_path):
    """The same weights under a transformers-4 config.json give the same logits: RoPE theta
    and scaling are read, not silently replaced by the default theta."""
    folder, hf_model = family_checkpoint
    for file in folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    _write_transformers4_config(tmp_path)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    runner = _runner(tmp_path)
    (prompt,) = _prompts(hf_model.config.vocab_size, [40], seed=7)
    logits = all_token_logits(runner, [Slice(prompt, 0, len(prompt), list(range(3)))])
    assert relative_error(logits, hf_logits(hf_model, prompt)) <= TOLERANCE


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_fp32(family_checkpoint, dtype):
    """Half-precision weights and cache run and stay close to the fp32 reference."""
    folder, hf_model = family_checkpoint
    runner = ModelRunner(RunnerConfig(model=folder, dtype=dtype, num_kv_blocks=8))
    assert runner.kv_caches[0].dtype == getattr(torch, dtype)
    (prompt,) = _prompts(hf_model.config.vocab_size, [20], seed=9)
    logits = all_token_logits(runner, [Slice(prompt, 0, len(prompt), [0, 1])])
    assert relative_error(logits, hf_logits(hf_model, prompt)) < 0.05
