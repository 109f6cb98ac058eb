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


def test_padded_decode_graph_path_matches_eager(tiny_llama, monkeypatch):
    """The decode-graph path (on CPU: the same padded static-buffer forward, run eagerly)
    gives the logits of the plain path: 5 requests of different lengths padded to 8, over
    several decode steps, then a batch that grew past a smaller size's buffers."""
    from tandem.attention import triton_backend
    from tandem.worker.model_runner import ModelRunner, RunnerConfig

    from helpers import Slice

    # A graph's plan splits every context as if it were long, into as many ranges as fill an
    # H200; 4-8 ranges (not 32-64) run the same split and merge in an eighth of the
    # interpreter's time.
    monkeypatch.setattr(triton_backend, "TARGET_PROGRAMS", 64)

    folder, _ = tiny_llama
    runners = {
        graphs: ModelRunner(RunnerConfig(
            model=folder, dtype="float32", attention_backend="triton", num_kv_blocks=64,
            decode_graph_max_batch=8 if graphs else 0, max_model_len=256,
        ))
        for graphs in (False, True)
    }  # fmt: skip
    assert runners[True].decode_graphs.sizes == [1, 2, 4, 8]
    assert runners[True].decode_graphs._metadata(8).backend_plan.num_splits == 4
    prompts = random_prompts(6, 320, 3, 40, seed=9)
    slices, next_block = [], 0
    for prompt in prompts:
        slices.append(Slice(list(prompt), 0, len(prompt), list(range(next_block, next_block + 4))))
        next_block += 4
    for step, batch in enumerate([slices[:5]] * 4 + [slices[:3]]):
        logits = {graphs: runner.execute(batch) for graphs, runner in runners.items()}
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
        next_ids = logits[False].argmax(-1).tolist()
        for s, token in zip(batch, next_ids, strict=True):
            s.num_computed_tokens += s.num_new_tokens
            s.token_ids.append(token)
            s.num_new_tokens = 1
        if step == 0:
            continue  # the prompts' step is mixed: it ran eagerly
        graphs = runners[True].decode_graphs
        size = 8 if len(batch) == 5 else 4
        assert graphs.slot_mapping[len(batch) : size].eq(-1).all()  # padded rows store nothing
