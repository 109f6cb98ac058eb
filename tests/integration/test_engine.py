"""The engine end to end: greedy output equals HF transformers' generate, and does not depend on
how the work was batched (token budget, seats, policy, preemption)."""

from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams

from helpers import assert_hf_greedy, assert_same_until_tie, random_prompts


def test_greedy_equals_hf_generate_for_every_family(family_checkpoint):
    folder, hf_model = family_checkpoint
    prompts = random_prompts(16, hf_model.config.vocab_size, 3, 60)
    llm = LLM(
        folder,
        dtype="float32",
        skip_tokenizer_init=True,
        max_num_batched_tokens=64,
        max_num_seqs=16,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_hf_greedy(hf_model, prompt, output.outputs[0].token_ids, 12)


ENGINE_VARIANTS = [
    dict(max_num_batched_tokens=16, max_num_seqs=4),
    dict(max_num_batched_tokens=64, max_num_seqs=1),
    dict(max_num_batched_tokens=64, max_num_seqs=4, max_num_partial_prefills=2),
    dict(max_num_batched_tokens=2048, max_num_seqs=256),
    dict(max_num_batched_tokens=64, max_num_seqs=16, batching_policy="prefill-first"),
    dict(max_num_batched_tokens=32, max_num_seqs=8, long_prefill_token_threshold=8),
    dict(max_num_batched_tokens=2048, max_num_seqs=256, block_size=4),
]


@pytest.fixture(scope="module")
def reference_run(tiny_llama):
    folder, _ = tiny_llama
    prompts = random_prompts(12, 320, 5, 70, seed=1)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, params, [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("variant", ENGINE_VARIANTS, ids=lambda v: ",".join(map(str, v.values())))
def test_output_independent_of_batching(tiny_llama, reference_run, variant):
    folder, _ = tiny_llama
    prompts, params, reference = reference_run
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, **variant)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for output, expected in zip(outputs, reference, strict=True):
        assert_same_until_tie(output.outputs[0].token_ids, expected.token_ids, expected.logprobs)
    stats = list(llm.step_stats)
    budget = variant["max_num_batched_tokens"]
    assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget for s in stats)
    assert all(s.num_seqs <= variant["max_num_seqs"] for s in stats)
    if variant.get("batching_policy") == "prefill-first":
        assert all(s.num_prefill_tokens == 0 or s.num_decode_tokens == 0 for s in stats)
    elif variant["max_num_seqs"] > 1 and budget < sum(map(len, prompts)):  # decode-first mixes
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)


def test_preemption_and_resume_keep_outputs(tiny_llama, reference_run):
    """A cache far too small for the batch: requests are preempted, recomputed, and still
    produce the same tokens."""
    folder, _ = tiny_llama
    prompts, params, reference = reference_run
    llm = LLM(
        folder,
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=14,
        enable_prefix_caching=False,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert any(s.num_preempted for s in llm.step_stats)
    for output, expected in zip(outputs, reference, strict=True):
        assert_same_until_tie(output.outputs[0].token_ids, expected.token_ids, expected.logprobs)
    assert llm.engine.core.kv_cache_manager.num_free_blocks == 14  # nothing leaked


def test_seeded_sampling_independent_of_batch_mates(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    target = {"prompt_token_ids": [5, 9, 200, 31, 7]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mates = [{"prompt_token_ids": p} for p in random_prompts(5, 320, 3, 40, seed=9)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([*mates[:3], target, *mates[3:]], [unseeded] * 3 + [seeded]
                         + [unseeded] * 2, use_tqdm=False)  # fmt: skip
    assert batch[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16,
                                ignore_eos=True)  # fmt: skip
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_sequences_and_metrics(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=10, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    metrics = output.outputs[0].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.finished_time
    assert len(metrics.token_times) == 10 and metrics.ttft > 0 and metrics.tpot > 0


def test_stop_token_ids_min_tokens_and_logprobs(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": [11, 12, 13]}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    (base,) = llm.generate([prompt], greedy, use_tqdm=False)
    tokens = base.outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    stopped = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]
    )
    (out,) = llm.generate([prompt], stopped, use_tqdm=False)
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    # logprobs: top-3 plus the chosen token, chosen = rank 1 under greedy.
    for token, row in zip(tokens, base.outputs[0].logprobs, strict=True):
        assert token in row and row[token].rank == 1 and len(row) == 3
    assert base.outputs[0].cumulative_logprob == pytest.approx(
        sum(row[t].logprob for t, row in zip(tokens, base.outputs[0].logprobs, strict=True))
    )


def test_bad_requests_are_rejected_and_engine_goes_on(tiny_llama):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 10}, {"prompt_token_ids": [1] * 100}], params,
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 10**9]}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (ok,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 4
    kv = llm.engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
