"""Async scheduling: each step is scheduled and prepared while the previous one's forward runs
on the executor thread. Outputs must be exactly those of stepping one at a time: greedy and
seeded, under preemption, aborts, stop tokens and strings, and with requests (penalties, prompt
logprobs) that make the engine step one at a time while they run."""

from __future__ import annotations

import threading
import time

import pytest

from tandem import LLM, SamplingParams
from tandem.request import PLACEHOLDER_TOKEN_ID

from helpers import assert_same_until_tie, random_prompts


def generate(folder, prompts, params, **kwargs):
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, **kwargs)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, 320, 5, 70, seed=1)


@pytest.fixture(scope="module")
def greedy_reference(tiny_llama, prompts):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    _, outputs = generate(tiny_llama[0], prompts, params, async_scheduling=False)
    return params, [o.outputs[0] for o in outputs]


@pytest.mark.parametrize(
    "variant",
    [
        dict(max_num_batched_tokens=16, max_num_seqs=4),
        dict(max_num_batched_tokens=2048, max_num_seqs=256),
        dict(max_num_batched_tokens=64, max_num_seqs=16, batching_policy="prefill-first"),
        dict(max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=14),  # preempts
    ],
    ids=["small-budget", "large", "prefill-first", "preempting"],
)
def test_greedy_outputs_equal_stepping_one_at_a_time(
    tiny_llama, prompts, greedy_reference, variant
):
    params, reference = greedy_reference
    llm, outputs = generate(tiny_llama[0], prompts, params, async_scheduling=True, **variant)
    core = llm.engine.core
    assert core.async_scheduling and not core.has_unfinished_requests()
    for output, expected in zip(outputs, reference, strict=True):
        assert_same_until_tie(output.outputs[0].token_ids, expected.token_ids, expected.logprobs)
        assert len(output.outputs[0].logprobs) == len(expected.token_ids)
        assert output.metrics.token_times == sorted(output.metrics.token_times)
    if "num_kv_blocks" in variant:
        assert any(s.num_preempted for s in llm.step_stats)
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaked
    assert sum(s.num_decode_tokens for s in llm.step_stats) >= 11 * len(prompts)


def test_seeded_sampling_stops_and_lengths_equal_stepping_one_at_a_time(tiny_llama, prompts):
    """Seeded rows draw the same numbers; stop tokens, min_tokens and max_tokens end requests
    at the same token, although the engine has already scheduled the next one for them."""
    first = generate(tiny_llama[0], prompts[:1], SamplingParams(temperature=0, max_tokens=8))
    stop_ids = first[1][0].outputs[0].token_ids[2:5]
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            seed=index,
            max_tokens=4 + index,
            min_tokens=index % 3,
            stop_token_ids=stop_ids if index % 2 else None,
            n=2 if index == 5 else 1,
        )
        for index in range(len(prompts))
    ]
    results = {}
    for mode in (False, True):
        llm, outputs = generate(tiny_llama[0], prompts, params, async_scheduling=mode,
                                num_kv_blocks=20)  # fmt: skip
        results[mode] = [
            [(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outputs
        ]
        kv = llm.engine.core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    assert results[True] == results[False]
    assert any(c[1] == "stop" for o in results[True] for c in o)


def test_requests_that_read_their_output_step_one_at_a_time(tiny_llama, prompts):
    """Penalties and prompt logprobs need the tokens in flight: while such a request runs the
    engine lands each step before the next, and the batch's outputs stay the same."""
    mixed = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2),
        *[SamplingParams(temperature=0, max_tokens=12)] * (len(prompts) - 2),
    ]
    results = {}
    for mode in (False, True):
        _, outputs = generate(tiny_llama[0], prompts, mixed, async_scheduling=mode)
        results[mode] = [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outputs]
    assert results[True] == results[False]


def test_aborts_while_a_step_is_in_flight_leak_nothing(tiny_llama, prompts):
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, async_scheduling=True,
              max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
    engine, core = llm.llm_engine, llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    finished = {}
    for step in range(200):
        if step in (2, 6, 9):  # mid-prompt, mid-decode
            engine.abort_request([str(step), str(step + 1)])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert not core.has_unfinished_requests()
    aborted = {"2", "3", "6", "7", "9", "10"}
    assert set(finished) == {str(i) for i in range(len(prompts))} - aborted
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    _, reference = generate(folder, [prompts[int(i)] for i in finished], params)
    assert [o.outputs[0].token_ids for o in reference] == list(finished.values())
    assert all(PLACEHOLDER_TOKEN_ID not in tokens for tokens in finished.values())


def test_stop_strings_end_at_the_same_text():
    prompts = ["List three colors, one per line:", "Count from one to ten in words:"]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["\n", "five"]),
              SamplingParams(temperature=0, max_tokens=40, stop=["seven"])]  # fmt: skip
    results = {}
    for mode in (False, True):
        llm = LLM("default", dtype="float32", async_scheduling=mode, num_kv_blocks=64)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(o.outputs[0].text, o.outputs[0].stop_reason) for o in outputs]
    assert results[True] == results[False]
    assert any(stop is not None for _, stop in results[True])


def test_the_next_step_is_scheduled_while_the_forward_runs(tiny_llama, prompts):
    """The point of it: schedule() runs on the caller's thread while a forward is running on
    the executor's."""
    folder, _ = tiny_llama
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, async_scheduling=True)
    core = llm.engine.core
    running = threading.Event()
    overlapped = []
    forward, schedule = core.runner.forward, core.scheduler.schedule

    def slow_forward(*args, **kwargs):
        running.set()
        time.sleep(0.02)  # a device's forward: no GIL held
        try:
            return forward(*args, **kwargs)
        finally:
            running.clear()

    def watched_schedule():
        overlapped.append(running.is_set())
        return schedule()

    core.runner.forward, core.scheduler.schedule = slow_forward, watched_schedule
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(overlapped) >= 5
    assert {t.name for t in threading.enumerate()} >= {"tandem-step_0"}


def test_async_scheduling_refuses_speculative_decoding(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling cannot be combined with speculative"):
        LLM(tiny_llama[0], skip_tokenizer_init=True, async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip


def test_server_with_async_scheduling(server_factory):
    """`tandem serve --async-scheduling`: a real client gets the offline engine's greedy text,
    streamed with a stop string, and a client that leaves mid-stream frees its blocks."""
    import httpx
    import openai

    from server_process import KV_CACHE_MEMORY_BYTES, wait_until_idle

    prompts = ["The three primary colors are", "A short poem about the sea:"]
    offline = LLM("default", dtype="float32", kv_cache_memory=KV_CACHE_MEMORY_BYTES,
                  async_scheduling=False)  # fmt: skip
    expected = [
        o.outputs[0].text
        for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=24),
                                  use_tqdm=False)
    ]  # fmt: skip
    server = server_factory.start("--async-scheduling", name="async-server")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    completion = client.completions.create(
        model="default", prompt=prompts, max_tokens=24, temperature=0
    )
    assert [choice.text for choice in completion.choices] == expected
    stop = expected[1].split()[3]
    stream = client.completions.create(
        model="default", prompt=prompts[1], max_tokens=24, temperature=0, stop=[stop],
        stream=True,
    )  # fmt: skip
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed == expected[1][: expected[1].index(stop)]
    body = {"model": "default", "prompt": prompts[0], "max_tokens": 2000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as reply:
        for number, _ in enumerate(reply.iter_lines()):
            if number == 5:
                break  # the client leaves mid-stream
    metrics = wait_until_idle(server.url)
    assert metrics["tandem:num_requests_running"] == 0
    assert "async scheduling: on" in server.log_path.read_text()
