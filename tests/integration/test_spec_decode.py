"""Speculative decoding end to end through the LLM API: greedy outputs equal the outputs
without it (across batch sizes, chunked prefill and preemption), drafts are really verified
and accepted, a stop inside an accepted run ends the output where it would have, seeded
sampling repeats, every block is returned, and the counters add up."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.engine_core import RETRY_DECLINED_EVERY

from helpers import AllowingGuard, assert_same_until_tie

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
FORCED = {**NGRAM, "adaptive": False}  # always verify what the proposer found

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the great "
    "lamp, wound the clockwork that turned the lens, and wrote the weather in a leather log. "
    "Ships passing the rocks saw the beam sweep across the water twice each minute."
)
GROUNDED = [
    f"Copy this paragraph exactly:\n\n{PASSAGE}\n\nCopy:\n",
    f"{PASSAGE}\n\nRepeat the second sentence word for word.\n",
    f"Text: {PASSAGE}\n\nList the things the keeper did, using the text's words.\n",
]


def assert_same_outputs(outputs, reference) -> None:
    assert len(outputs) == len(reference)
    for output, expected in zip(outputs, reference, strict=True):
        for completion, expected_completion in zip(output.outputs, expected.outputs, strict=True):
            assert_same_until_tie(
                completion.token_ids, expected_completion.token_ids, expected_completion.logprobs
            )


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def smollm_reference():
    llm = LLM("default", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    return llm.generate(GROUNDED, params, use_tqdm=False)


@pytest.mark.parametrize("speculative_config", [NGRAM, FORCED], ids=["adaptive", "forced"])
def test_greedy_output_equals_plain_decoding_on_the_embedded_model(
    speculative_config, smollm_reference
):
    llm = LLM("default", dtype="float32", speculative_config=speculative_config)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    batched = llm.generate(GROUNDED, params, use_tqdm=False)
    alone = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in GROUNDED]
    assert_same_outputs(batched, smollm_reference)
    assert_same_outputs(alone, smollm_reference)
    for output in batched + alone:
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids)
    stats = llm.llm_engine.core.spec_decode_stats
    assert stats.num_accepted_tokens > 0, "copying a passage must accept some drafts"
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    drafted = sum(o.metrics.num_draft_tokens for o in batched + alone)
    accepted = sum(o.metrics.num_accepted_tokens for o in batched + alone)
    assert (drafted, accepted) == (stats.num_draft_tokens, stats.num_accepted_tokens)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert_all_blocks_free(llm)


def test_stop_string_and_max_tokens_inside_accepted_runs(smollm_reference):
    llm = LLM("default", dtype="float32", speculative_config=FORCED)
    plain = LLM("default", dtype="float32")
    reference_text = smollm_reference[0].outputs[0].text
    # A stop string from the middle of the copied text, and a max_tokens that lands mid-run.
    stop = reference_text.split()[6]
    for params in (
        SamplingParams(temperature=0, max_tokens=48, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=13),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, ignore_eos=True),
    ):
        expected = plain.generate(GROUNDED[:1], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate(GROUNDED[:1], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (
            expected.text, expected.token_ids, expected.finish_reason,
        )  # fmt: skip
    assert llm.llm_engine.core.spec_decode_stats.num_accepted_tokens > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_repeats_with_speculation():
    llm = LLM("default", dtype="float32", speculative_config=FORCED)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32)
    first = llm.generate(GROUNDED, params, use_tqdm=False)
    again = llm.generate(GROUNDED[:1], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert llm.llm_engine.core.spec_decode_stats.num_draft_tokens > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_equals_plain_decoding(tiny_folder):
    """A seeded request spends one uniform per token with or without drafts, and a draft is
    kept only where plain sampling would have drawn it: the same tokens."""
    prompts = [{"prompt_token_ids": p} for p in loop_prone_prompts(6, seed=4)]
    params = [SamplingParams(temperature=0.3, seed=20 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    plain = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True)
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, speculative_config=FORCED)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.core.spec_decode_stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def tiny_folder(tiny_llama):
    return tiny_llama[0]


def loop_prone_prompts(count: int, seed: int = 3) -> list[list[int]]:
    """Prompts that repeat a short random phrase: a random model's greedy continuation tends
    to repeat too, so drafts are found and often accepted."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(320) for _ in range(rng.randint(3, 6))]
        prompts.append(phrase * rng.randint(2, 8) + [rng.randrange(320)])
    return prompts


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"max_num_batched_tokens": 24, "max_num_seqs": 8, "long_prefill_token_threshold": 12},
        {"num_kv_blocks": 14, "block_size": 4},
        {"batching_policy": "prefill-first"},
    ],
    ids=["default", "chunked", "preempting", "prefill-first"],
)
def test_greedy_equal_with_and_without_speculation_under_engine_pressure(tiny_folder, engine_args):
    prompts = [{"prompt_token_ids": p} for p in loop_prone_prompts(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    reference = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, **engine_args)
    expected = reference.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, speculative_config=FORCED,
              **engine_args)  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    core = llm.llm_engine.core
    assert core.spec_decode_stats.num_accepted_tokens > 0
    if "num_kv_blocks" in engine_args:
        assert core.num_preemptions > 0, "the small cache must force preemptions"
    assert_all_blocks_free(llm)
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == [len(o.outputs[0].token_ids) for o in expected]  # max_tokens, cache size


def test_n_and_mixed_sampling_in_one_batch(tiny_folder):
    """Greedy, sampled and penalised requests, n > 1, in one speculative batch: greedy ones
    equal plain decoding and every request gets what it asked for."""
    prompts = loop_prone_prompts(4, seed=5)
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, speculative_config=FORCED)
    plain = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    params = [
        greedy,
        SamplingParams(temperature=1.0, n=3, max_tokens=20, ignore_eos=True, seed=1),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                       logprobs=2),
        SamplingParams(temperature=0.7, top_k=5, max_tokens=20, ignore_eos=True),
    ]  # fmt: skip
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    expected = plain.generate([requests[0], requests[2]], [params[0], params[2]], use_tqdm=False)
    assert_same_outputs([outputs[0], outputs[2]], expected)
    assert len(outputs[1].outputs) == 3
    assert all(len(c.token_ids) == 20 for o in outputs for c in o.outputs)
    assert_all_blocks_free(llm)


def draft_config(model, **extra):
    return {"model": str(model), "num_speculative_tokens": 3, "adaptive": False, **extra}


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"num_kv_blocks": 14, "block_size": 4}, {"max_num_batched_tokens": 24, "max_num_seqs": 8}],
    ids=["default", "preempting", "chunked"],
)
def test_draft_model_greedy_equals_plain_decoding(tiny_folder, engine_args):
    """The tiny model in bf16 drafts for its fp32 self: its guesses are mostly right, and the
    fp32 output is unchanged, under preemption (the draft's KV is rebuilt) and chunking."""
    prompts = [{"prompt_token_ids": p} for p in loop_prone_prompts(10, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, **engine_args)
    expected = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True,
              speculative_config=draft_config(tiny_folder, draft_dtype="bfloat16"),
              **engine_args)  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_outputs(outputs, expected)
    stats = llm.llm_engine.core.spec_decode_stats
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate > 0.5, "a bf16 copy of the target must guess mostly right"
    if "num_kv_blocks" in engine_args:
        assert llm.llm_engine.core.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_a_draft_catches_up_a_backlog_once_and_learns_what_it_costs(tiny_folder):
    """A new request's prompt is the draft's backlog: caught up in a forward of its own,
    timed apart (paid once, not by every step that drafts). After it, each step's first draft
    forward covers only the tokens the target accepted, so there is no backlog; and the
    draft's cost model, fed by every forward, forecasts what guessing costs."""
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True,
              speculative_config=draft_config(tiny_folder, draft_dtype="bfloat16"))  # fmt: skip
    proposer = llm.llm_engine.core.proposer
    propose, seen = proposer.propose, []

    def recording(requests, limits):
        forecast = proposer.forecast_seconds(requests, limits)
        drafts = propose(requests, limits)
        if any(limits):
            seen.append((forecast, proposer.catch_up_seconds))
        return drafts

    proposer.propose = recording
    prompt = {"prompt_token_ids": list(range(5, 125))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    assert seen[0][0] is None  # nothing learned before the first forward
    assert seen[0][1] > 0
    assert all(catch_up == 0 for _, catch_up in seen[1:])
    forecasts = [forecast for forecast, _ in seen if forecast is not None]
    assert forecasts, "the draft's cost model never fitted a line"
    assert all(steady > 0 and once == 0 for steady, once in forecasts)
    # A request the draft has not seen: its prompt is forecast as a backlog.
    seen.clear()
    prompt = {"prompt_token_ids": list(range(200, 320))}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    (_, once), catch_up = seen[0]
    assert once > 0 and catch_up > 0
    assert_all_blocks_free(llm)


def test_a_draft_reuses_its_kv_of_a_cached_prefix_and_never_of_evicted_content(tiny_folder):
    """A prompt run again finds its blocks by prefix, and the draft finds its own KV in them:
    it catches up less than a block instead of the whole prompt. Once other prompts have
    evicted those blocks and written other content into them, nothing is taken from them:
    the outputs stay exact and the draft's guesses right."""
    engine_args = {"num_kv_blocks": 40, "block_size": 8, "skip_tokenizer_init": True}
    llm = LLM(tiny_folder, dtype="float32",
              speculative_config=draft_config(tiny_folder, draft_dtype="bfloat16"),
              **engine_args)  # fmt: skip
    plain = LLM(tiny_folder, dtype="float32", **engine_args)
    proposer = llm.llm_engine.core.proposer
    catch_up, caught_up = proposer._catch_up, []

    def recording(slices):
        caught_up.append(sum(s.num_new_tokens for s in slices))
        catch_up(slices)

    proposer._catch_up = recording
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": loop_prone_prompts(1, seed=5)[0] * 4}
    num_prompt = len(prompt["prompt_token_ids"])
    assert num_prompt > 3 * 8
    expected = plain.generate([prompt], params, use_tqdm=False)
    assert_same_outputs(llm.generate([prompt], params, use_tqdm=False), expected)
    assert caught_up[0] >= num_prompt - 4  # all but the step's own last tokens
    caught_up.clear()
    assert_same_outputs(llm.generate([prompt], params, use_tqdm=False), expected)
    assert not caught_up or caught_up[0] < 8  # less than a block
    # Other prompts take more than the 40 blocks from the free queue's head, so every block
    # is handed out again and the first prompt's content is gone from all of them.
    others = [{"prompt_token_ids": p * 3} for p in loop_prone_prompts(8, seed=11)]
    assert sum(-(-(len(p["prompt_token_ids"]) + 16) // 8) for p in others) > 40
    llm.generate(others, params, use_tqdm=False)
    caught_up.clear()
    before = llm.llm_engine.core.spec_decode_stats.num_accepted_tokens
    assert_same_outputs(llm.generate([prompt], params, use_tqdm=False), expected)
    assert caught_up[0] >= num_prompt - 4
    stats = llm.llm_engine.core.spec_decode_stats
    assert stats.num_accepted_tokens - before > 8
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("guessing_seconds", [0.0, 10.0])
def test_a_draft_guesses_only_where_its_forecast_cost_leaves_a_gain(tiny_folder, guessing_seconds):
    """Adaptive: once the target's step-cost model has a line, the engine asks the draft's
    forecast before each guess. A draft forecast to cost nothing goes on guessing; one
    forecast at 10 s a step stops as soon as the forecast counts, and once refused twice in a
    row, the forecast is asked only every RETRY_DECLINED_EVERY steps."""
    config = {**draft_config(tiny_folder, draft_dtype="bfloat16"), "adaptive": True}
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True,
              speculative_config=config)  # fmt: skip
    core = llm.llm_engine.core
    core.scheduler.speculation_guard = AllowingGuard()
    proposer = core.proposer
    propose, fitted_when_guessing = proposer.propose, []

    def recording(requests, limits):
        fitted_when_guessing.append(core.cost_model.coefficients is not None)
        return propose(requests, limits)

    proposer.propose = recording
    asked = []  # the steps done when the forecast counted

    def forecast(requests, limits):
        if core.cost_model.coefficients is not None:
            asked.append(core.num_steps)
        return guessing_seconds, 0.0

    proposer.forecast_seconds = forecast
    prompts = [{"prompt_token_ids": p} for p in loop_prone_prompts(4, seed=3)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    assert core.cost_model.coefficients is not None
    assert any(fitted_when_guessing) == (guessing_seconds == 0.0)
    if guessing_seconds:  # refused at every ask
        assert asked[1] == asked[0] + 1 and len(asked) >= 4
        assert all(step % RETRY_DECLINED_EVERY == 0 for step in asked[2:])
    else:  # asked before every guess (the scheduler declining them is another matter)
        assert any(after == before + 1 for before, after in itertools.pairwise(asked[2:]))
    assert_all_blocks_free(llm)


def test_embedded_model_drafts_for_its_float32_self(smollm_reference):
    """The draft that works here without a download: the embedded model with dtype "auto"
    (packed 4-bit weights on CPU) drafting for the same model in float32."""
    llm = LLM("default", dtype="float32",
              speculative_config={"model": "default", "num_speculative_tokens": 3})  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    outputs = llm.generate(GROUNDED, params, use_tqdm=False)
    assert_same_outputs(outputs, smollm_reference)
    stats = llm.llm_engine.core.spec_decode_stats
    assert stats.acceptance_rate > 0.5
    assert_all_blocks_free(llm)


def test_a_draft_must_share_the_vocabulary(tiny_folder):
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM("default", speculative_config=draft_config(tiny_folder))


def test_server_speculates_and_reports_it(server_factory, smollm_reference):
    """`tandem serve --speculative-config`: a real client gets plain greedy decoding's text,
    streamed or not (a stop string inside an accepted run included), and /metrics counts the
    drafts."""
    import openai

    from server_process import wait_until_idle

    server = server_factory.start("--speculative-config", json.dumps(FORCED), name="spec-server")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    expected = smollm_reference[0].outputs[0]
    completion = client.completions.create(
        model="default", prompt=GROUNDED[0], max_tokens=48, temperature=0
    )
    assert completion.choices[0].text == expected.text
    stop = expected.text.split()[5]
    stream = client.completions.create(
        model="default", prompt=GROUNDED[0], max_tokens=48, temperature=0, stop=[stop],
        stream=True,
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == expected.text[: expected.text.index(stop)]
    metrics = wait_until_idle(server.url)
    drafted = metrics["tandem:spec_decode_num_draft_tokens_total"]
    accepted = metrics["tandem:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert metrics["tandem:spec_decode_num_drafts_total"] > 0
    assert metrics["tandem:spec_decode_num_accepted_tokens_per_pos_total"] == accepted
