"""The whole engine on the triton attention backend (on CPU under TRITON_INTERPRET=1) against
the torch backend: greedy tokens and their logprobs over a mixed workload with chunked
prefill, prefix-cache hits and decodes of many lengths in one step."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
pytest.importorskip("triton")

from tandem import LLM, SamplingParams

from helpers import assert_same_until_tie, random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


def test_triton_backend_generates_what_the_torch_backend_does(tiny_llama):
    folder, _ = tiny_llama
    shared = random_prompts(1, 320, 40, 40, seed=5)[0]  # a prefix later prompts hit in cache
    prompts = [shared + p for p in random_prompts(3, 320, 2, 30, seed=6)]
    prompts += random_prompts(3, 320, 3, 70, seed=7)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            folder, skip_tokenizer_init=True, dtype="float32", attention_backend=backend,
            max_num_batched_tokens=48, max_num_seqs=8,  # prompts in chunks beside decodes
        )  # fmt: skip
        assert llm.config.runner.attention_backend == backend
        runs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert any(o.num_cached_tokens for o in runs["triton"])  # the shared prefix was a hit
    for got, expected in zip(runs["triton"], runs["torch"], strict=True):
        reference = expected.outputs[0]
        assert_same_until_tie(got.outputs[0].token_ids, reference.token_ids, reference.logprobs)
        for got_step, expected_step in zip(got.outputs[0].logprobs, reference.logprobs,
                                           strict=True):  # fmt: skip
            for token_id, logprob in expected_step.items():
                if token_id in got_step:
                    assert got_step[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)

