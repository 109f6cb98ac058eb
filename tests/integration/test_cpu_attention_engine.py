"""The whole engine on the cpu attention backend (decode attention in the C kernel, in place)
against the torch backend: greedy tokens and their logprobs over a mixed workload with chunked
prefill, prefix-cache hits, decodes of many lengths in one step, and draft verification."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

from helpers import assert_same_until_tie, needs_cpu_kernels, random_prompts

pytestmark = needs_cpu_kernels

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculative", [False, True])
def test_cpu_backend_generates_what_the_torch_backend_does(tiny_llama, dtype, speculative):
    folder, _ = tiny_llama
    shared = random_prompts(1, 320, 40, 40, seed=5)[0]  # a prefix later prompts hit in cache
    prompts = [shared + p for p in random_prompts(3, 320, 2, 30, seed=6)]
    prompts += random_prompts(3, 320, 3, 70, seed=7)
    # Prompt lookup proposes drafts from repeats: verification steps of several tokens.
    prompts += [[11, 12, 13, 14] * 12]
    runs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            folder, skip_tokenizer_init=True, dtype=dtype, attention_backend=backend,
            max_num_batched_tokens=48, max_num_seqs=8,  # prompts in chunks beside decodes
            speculative_config=(
                {"method": "ngram", "num_speculative_tokens": 3} if speculative else None
            ),
        )  # fmt: skip
        assert llm.config.runner.attention_backend == backend
        runs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert any(o.num_cached_tokens for o in runs["cpu"])  # the shared prefix was a hit
    tolerance = 1e-3 if dtype == "float32" else 5e-2
    for got, expected in zip(runs["cpu"], runs["torch"], strict=True):
        reference = expected.outputs[0]
        assert_same_until_tie(got.outputs[0].token_ids, reference.token_ids, reference.logprobs)
        # Logprobs step by step while both runs have produced the same tokens (after a near-tie
        # went the other way their contexts differ).
        same = 0
        while same < len(reference.token_ids) and (
            got.outputs[0].token_ids[same] == reference.token_ids[same]
        ):
            same += 1
        for got_step, expected_step in zip(
            got.outputs[0].logprobs[: same + 1], reference.logprobs[: same + 1], strict=True
        ):
            for token_id, logprob in expected_step.items():
                if token_id in got_step:
                    assert got_step[token_id].logprob == pytest.approx(
                        logprob.logprob, abs=tolerance
                    )
