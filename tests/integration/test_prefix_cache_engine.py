"""Prefix caching through the public LLM API on a tiny random model: the same greedy output with
and without the cache (a long prefix shared by many prompts, eviction pressure, preemption, and
forced hash collisions), and the hits visible in each request's metrics and in the counters."""

from __future__ import annotations

import random

import pytest

from tandem import LLM, SamplingParams
from tandem.core.kv_cache_manager import BLOCK_HASH_FUNCTIONS

from helpers import assert_same_until_tie

BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

_rng = random.Random(7)
SHARED = [_rng.randrange(320) for _ in range(4 * BLOCK)]  # a long shared "system prompt"
PROMPTS = [SHARED + [_rng.randrange(320) for _ in range(_rng.randint(3, 20))] for _ in range(10)]
# Equal 16-token blocks at other positions and after other prefixes: a hash that ignored the
# parent would find them all.
_A, _B, _C = ([_rng.randrange(320) for _ in range(BLOCK)] for _ in range(3))
REPEATS = [
    _A + _B + _C + [1, 2, 3],
    _B + _A + _C + [1, 2, 3],
    _C + _A + _B + [4],
    _A + _A + _B + [5, 6],
    _B + _B + _A + _A + [7],
    _A + _B + _C + [1, 2, 3],
]


def assert_same_outputs(outputs, reference) -> None:
    """Equal greedy tokens, up to the first near-tie of the reference (where fp32 noise from a
    different batching may flip the argmax)."""
    assert len(outputs) == len(reference)
    for output, expected in zip(outputs, reference, strict=True):
        expected_completion = expected.outputs[0]
        assert_same_until_tie(
            output.outputs[0].token_ids, expected_completion.token_ids, expected_completion.logprobs
        )


def generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def cached_tokens(outputs) -> list[int]:
    return [o.metrics.num_cached_tokens for o in outputs]


@pytest.fixture(scope="module")
def tiny_folder(tiny_llama):
    return tiny_llama[0]


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """Outputs with caching off, each prompt set in its own call; and the engine's counters."""
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False)
    outputs = generate(llm, PROMPTS), generate(llm, REPEATS)
    return outputs, llm.engine.core.kv_cache_manager


def test_caching_off_reports_no_hits(reference) -> None:
    (shared_out, repeat_out), kv = reference
    assert cached_tokens(shared_out) == [0] * len(PROMPTS)
    assert cached_tokens(repeat_out) == [0] * len(REPEATS)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def small_budget_llm(folder) -> LLM:
    """A small budget admits the prompts over several steps, so later ones find the prefix."""
    return LLM(folder, dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=64,
               max_num_seqs=4)  # fmt: skip


def test_shared_prefix_hits_and_outputs_equal_uncached(tiny_folder, reference) -> None:
    (shared_ref, _), _ = reference
    llm = small_budget_llm(tiny_folder)
    kv = llm.engine.core.kv_cache_manager
    outputs = generate(llm, PROMPTS)
    assert_same_outputs(outputs, shared_ref)
    hits = cached_tokens(outputs)
    assert hits[0] == 0
    assert all(hit > 0 and hit % BLOCK == 0 for hit in hits[1:])
    assert max(hits) >= len(SHARED)
    assert kv.prefix_cache_queries == sum(map(len, PROMPTS))
    assert kv.prefix_cache_hits == sum(hits)
    # Again: every full block of every prompt is cached now, all but the last token hits.
    again = generate(llm, PROMPTS)
    assert_same_outputs(again, shared_ref)
    assert cached_tokens(again) == [(len(p) - 1) // BLOCK * BLOCK for p in PROMPTS]
    assert kv.prefix_cache_hits == sum(hits) + sum(cached_tokens(again))
    assert kv.num_free_blocks == kv.num_blocks


def test_outputs_equal_under_eviction_and_preemption(tiny_folder, reference) -> None:
    (shared_ref, repeat_ref), _ = reference
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=14)
    kv = llm.engine.core.kv_cache_manager
    pool = kv.block_pool
    evicted = []
    evict = pool.evict_cached_block

    def counting_evict(block) -> None:
        if block.block_hash is not None:
            evicted.append(block.block_hash)
        evict(block)

    pool.evict_cached_block = counting_evict
    outputs = generate(llm, PROMPTS)
    assert_same_outputs(outputs, shared_ref)
    repeat_outputs = generate(llm, REPEATS)
    assert_same_outputs(repeat_outputs, repeat_ref)
    every = [*outputs, *repeat_outputs]
    assert sum(o.metrics.num_preemptions for o in every) > 0
    assert evicted
    assert sum(cached_tokens(every)) > 0
    # resumes after preemption recompute (and may hit) their blocks: never counted
    assert kv.prefix_cache_hits == sum(cached_tokens(every))
    assert kv.prefix_cache_queries == sum(map(len, PROMPTS + REPEATS))
    assert kv.num_free_blocks == 14  # nothing leaked


@pytest.mark.parametrize("collision", ["constant", "tokens_only"])
def test_hash_collisions_never_corrupt_outputs(tiny_folder, reference, monkeypatch, collision):
    def constant(parent: int, tokens, extra: bytes) -> int:
        return 42

    def tokens_only(parent: int, tokens, extra: bytes) -> int:
        return hash(tuple(tokens))

    hash_fn = constant if collision == "constant" else tokens_only
    monkeypatch.setitem(BLOCK_HASH_FUNCTIONS, "xxhash", hash_fn)
    (shared_ref, repeat_ref), _ = reference
    llm = small_budget_llm(tiny_folder)
    assert_same_outputs(generate(llm, REPEATS), repeat_ref)
    assert_same_outputs(generate(llm, PROMPTS), shared_ref)
    again = generate(llm, REPEATS)
    assert_same_outputs(again, repeat_ref)
    # the last prompt repeats the first: its first block at least is a true hit
    assert cached_tokens(again)[0] >= BLOCK


def test_reset_prefix_cache(tiny_folder, reference) -> None:
    (shared_ref, _), _ = reference
    llm = LLM(tiny_folder, dtype="float32", skip_tokenizer_init=True)
    kv = llm.engine.core.kv_cache_manager
    generate(llm, PROMPTS[:1])
    assert kv.block_pool.num_cached_blocks > 0
    llm.engine.add_request("running", PROMPTS[1], PARAMS)
    llm.engine.step()
    assert not kv.reset_prefix_cache()  # a request holds blocks: refused
    assert kv.block_pool.num_cached_blocks > 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert kv.reset_prefix_cache()
    assert kv.block_pool.num_cached_blocks == 0
    outputs = generate(llm, PROMPTS[:2])
    assert cached_tokens(outputs)[0] == 0
    assert_same_outputs(outputs, shared_ref[:2])
