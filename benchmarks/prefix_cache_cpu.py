"""Prefix caching on CPU (SmolLM2-135M fp32): caching on against off in the same run.

1. Shared prefix: 32 requests = one 1,024-token system prompt + a different 32-token question,
   32 new tokens each; sent one at a time (TTFT without queueing) and all at once (throughput).
2. Multi-turn chat: 6 turns, each re-sending the whole history; TTFT per turn.
3. Overhead when nothing hits: unique prompts; the share of step time spent hashing and looking
   up blocks.

    .venv/bin/python benchmarks/prefix_cache_cpu.py
"""

from __future__ import annotations

import datetime
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

from tandem import LLM, SamplingParams
from tandem.core.kv_cache_manager import KVCacheManager

VOCAB = 49152
QUESTIONS = [
    "What is a black hole?",
    "Can light escape from it?",
    "How are they formed?",
    "What is the nearest one to Earth?",
    "Could we ever visit it?",
    "Summarise what we discussed.",
]


def tokens(count: int, rng: random.Random) -> list[int]:
    return [rng.randrange(17, VOCAB) for _ in range(count)]


def shared_prefix(llm: LLM) -> tuple[float, float, float]:
    """(median TTFT one at a time, throughput all at once in output tok/s, hit rate)."""
    rng = random.Random(0)
    system = tokens(1024, rng)
    prompts = [{"prompt_token_ids": system + tokens(32, rng)} for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ttfts = []
    for prompt in prompts[:8]:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        ttfts.append(out.metrics.ttft)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return statistics.median(ttfts[1:]), 32 * 32 / elapsed, cached / prompt_tokens


def multi_turn(llm: LLM) -> list[float]:
    conversation = [{"role": "system", "content": "You are a patient astronomy teacher. " * 20}]
    ttfts = []
    for question in QUESTIONS:
        conversation.append({"role": "user", "content": question})
        (out,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=48),
                          use_tqdm=False)  # fmt: skip
        ttfts.append(out.metrics.ttft)
        conversation.append({"role": "assistant", "content": out.outputs[0].text})
    return ttfts


def timed_methods(manager: KVCacheManager, names: list[str]) -> Callable[[], float]:
    """Wrap the manager's prefix-cache methods with a stopwatch; returns a reader."""
    spent = [0.0]
    for name in names:
        method = getattr(manager, name)

        def wrapper(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(manager, name, wrapper)
    return lambda: spent[0]


def no_hit_overhead(llm: LLM) -> tuple[float, float]:
    """(seconds in prefix-cache code, seconds of step time) for unique prompts."""
    manager = llm.engine.core.kv_cache_manager
    read = timed_methods(manager, ["get_computed_blocks", "cache_blocks"])
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": tokens(rng.randint(64, 512), rng)} for _ in range(32)]
    llm.engine.core.step_stats.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    return read(), sum(s.step_time for s in llm.engine.core.step_stats)


def main() -> None:
    print(
        f"# prefix_cache_cpu  {datetime.date.today()}  {platform.machine()}  "
        f"{torch.get_num_threads()} threads  torch {torch.__version__}  SmolLM2-135M fp32"
    )
    results = {}
    for caching in (True, False):
        llm = LLM("default", dtype="float32", enable_prefix_caching=caching)
        llm.generate(["warm-up"], SamplingParams(max_tokens=4), use_tqdm=False)
        results[caching] = (shared_prefix(llm), multi_turn(llm))
        if caching:
            results["overhead"] = no_hit_overhead(llm)
        del llm

    (on_ttft, on_tput, on_hits), on_turns = results[True]
    (off_ttft, off_tput, _), off_turns = results[False]
    print("\n## Shared 1,024-token prefix, 32 requests of +32 prompt / 32 new tokens")
    print("| prefix caching | median TTFT, one at a time | output tok/s, all at once | "
          "prompt tokens from cache |")  # fmt: skip
    print("|---|---:|---:|---:|")
    print(f"| on | {on_ttft * 1e3:.0f} ms | {on_tput:.1f} | {on_hits:.0%} |")
    print(f"| off | {off_ttft * 1e3:.0f} ms | {off_tput:.1f} | 0% |")
    print(f"| on/off | {off_ttft / on_ttft:.1f}× faster | {on_tput / off_tput:.2f}× | |")
    print("\n## Multi-turn chat re-sending its history (TTFT per turn)")
    print("| turn | " + " | ".join(str(i + 1) for i in range(len(QUESTIONS))) + " |")
    print("|---|" + "---:|" * len(QUESTIONS))
    print("| on | " + " | ".join(f"{t * 1e3:.0f} ms" for t in on_turns) + " |")
    print("| off | " + " | ".join(f"{t * 1e3:.0f} ms" for t in off_turns) + " |")
    spent, step_time = results["overhead"]
    print("\n## Nothing hits: 32 unique prompts of 64-512 tokens, 32 new tokens each")
    print(f"prefix-cache hashing and lookups: {spent * 1e3:.1f} ms of {step_time:.2f} s step "
          f"time = {spent / step_time:.3%}")  # fmt: skip


if __name__ == "__main__":
    main()
