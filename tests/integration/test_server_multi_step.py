"""Multi-step scheduling behind the server: `tandem serve --dtype auto` runs a lone
request in bursts of forwards where the CPU's decode steps run fused (its default); the
stream carries a burst's tokens together, and its text, tokens, stops and usage are those of
the offline engine running one forward a step, seeded sampling included; a client that
hangs up mid-stream leaves nothing behind."""

from __future__ import annotations

import httpx
import openai
import pytest

from tandem import LLM, SamplingParams
from tandem.engine.config import EngineConfig

from greedy_reference import assert_same_greedy
from server_process import KV_CACHE_MEMORY_BYTES, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300, func_only=True)]

PROMPT = "The capital of France is"
NUM_TOKENS = 48


def test_a_lone_stream_in_bursts_equals_one_forward_a_step(server_factory):
    server = server_factory.start("--dtype", "auto")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    single = LLM("default", kv_cache_memory=KV_CACHE_MEMORY_BYTES, num_scheduler_steps=1)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    reference = single.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    chunks = list(
        client.completions.create(
            model="default", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )  # fmt: skip
    *body, last = chunks
    token_ids = [t for chunk in body for t in chunk.choices[0].token_ids or []]
    text = "".join(chunk.choices[0].text for chunk in body)
    assert_same_greedy(token_ids, text, reference, "streamed completion in bursts")
    assert last.usage.completion_tokens == NUM_TOKENS
    per_chunk = [len(chunk.choices[0].token_ids or []) for chunk in body]
    if EngineConfig.create("default", device="cpu").scheduler.num_scheduler_steps > 1:
        assert max(per_chunk) > 1, "no burst reached the stream"

    # A stop string inside a burst: the text ends where the offline engine's does.
    stop = reference.text[len(reference.text) // 2 :].split()[0]
    stopped = single.generate(PROMPT, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                     ignore_eos=True, stop=[stop]),
                              use_tqdm=False)[0].outputs[0]  # fmt: skip
    answer = client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=NUM_TOKENS,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert (answer.text, answer.finish_reason) == (stopped.text, "stop")

    # A seeded sampled stream bursts too, and gives the offline engine's tokens; a client that
    # hangs up mid-stream is aborted between bursts and leaves no block behind.
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    sampled_params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **seeded)
    sampled = single.generate(PROMPT, sampled_params, use_tqdm=False)[0].outputs[0]
    answer = client.completions.create(
        model="default", prompt=PROMPT, max_tokens=NUM_TOKENS,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **seeded,
    ).choices[0]  # fmt: skip
    assert answer.token_ids == sampled.token_ids
    body = {"model": "default", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
            "stream": True, **seeded}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # hang up
    samples = wait_until_idle(server.url)
    assert samples["tandem:request_success_total[abort]"] >= 1
