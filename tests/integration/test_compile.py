"""compilation_config > 0: each layer's halves around attention run torch.compiled, with the
eager model's outputs (greedy tokens equal, logprobs within float rounding), across step
shapes (a whole prompt, prompt chunks mixed with decodes, single decodes)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_compiled_layers_give_the_eager_outputs(tiny_llama):
    folder, _ = tiny_llama
    knobs = dict(
        dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=24, max_num_seqs=4
    )
    eager = LLM(folder, **knobs)
    compiled = LLM(folder, compilation_config={"level": 3}, **knobs)
    torch._dynamo.reset()
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    expected = eager.generate(prompts, params, use_tqdm=False)
    for _ in range(2):  # the second pass reuses the compiled graphs
        outputs = compiled.generate(prompts, params, use_tqdm=False)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
        for ours, theirs in zip(outputs, expected, strict=True):
            assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
            for mine, reference in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs,
                                       strict=True):  # fmt: skip
                assert mine.keys() == reference.keys()
                got = torch.tensor([mine[t].logprob for t in reference])
                want = torch.tensor([reference[t].logprob for t in reference])
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
