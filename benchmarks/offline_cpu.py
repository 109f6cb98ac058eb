"""Offline engine benchmarks on CPU (SmolLM2-135M fp32, the embedded GGUF).

1. Throughput: 64 prompts of 32-512 tokens, 128 new tokens each: tandem's LLM.generate against
   HF transformers' batched generate (left-padded, one batch) in the same run.
2. Stutter: 8 decode streams are running when a 1,500-token prompt arrives. For each policy,
   the longest gap between two tokens of any stream after the arrival, and the long prompt's
   TTFT: decode-first chunking keeps the streams moving, prefill-first freezes them.

    .venv/bin/python benchmarks/offline_cpu.py [--skip-hf] [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import random
import time

import torch

from tandem import LLM, SamplingParams
from tandem.engine.llm_engine import OutputKind
from tandem.models.loader import resolve_model_path

NEW_TOKENS = 128


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random ordinary tokens (ids past the 17 special tokens of SmolLM2's vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(17, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def tandem_throughput(prompts: list[list[int]]) -> tuple[float, int]:
    llm = LLM("default", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def hf_throughput(prompts: list[list[int]]) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("default")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    width = max(map(len, prompts))
    pad = 2
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - width) * len(prompts)


def stutter(policy: str, budget: int, vocab: int) -> tuple[float, float, float]:
    """(max inter-token gap of the 8 streams after the long prompt arrives, the gap they see
    without it, the long prompt's TTFT), in seconds."""
    llm = LLM("default", dtype="float32", batching_policy=policy, max_num_batched_tokens=budget,
              enable_prefix_caching=False)  # fmt: skip
    engine = llm.llm_engine
    streams = random_prompts(8, 32, 64, vocab, seed=1)
    (long_prompt,) = random_prompts(1, 1500, 1500, vocab, seed=2)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for index, prompt in enumerate(streams):
        engine.add_request(f"s{index}", prompt, params, output_kind=OutputKind.CUMULATIVE)
    produced = 0
    while produced < 30:  # let the streams settle into decoding
        outputs = engine.step()
        if len(outputs) == len(streams):
            produced = min(len(o.outputs[0].token_ids) for o in outputs)
    arrival = time.monotonic()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))  # fmt: skip
    long_output = None
    latest = {}
    while long_output is None or not long_output.finished:
        for output in engine.step():
            if output.request_id == "long":
                long_output = output
            else:
                latest[output.request_id] = output.outputs[0].metrics
    for index in range(8):
        engine.abort_request(f"s{index}")
    gaps_after, gaps_before = [], []
    for metrics in latest.values():
        times = metrics.token_times
        for a, b in itertools.pairwise(times):
            (gaps_after if b > arrival else gaps_before).append(b - a)
    ttft = long_output.outputs[0].metrics.first_token_time - arrival
    return max(gaps_after), sorted(gaps_before)[len(gaps_before) // 2], ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    vocab = 49152
    prompts = random_prompts(args.num_prompts, 32, 512, vocab)
    header = (
        f"{datetime.date.today()}  {platform.machine()}  {torch.get_num_threads()} threads  "
        f"torch {torch.__version__}  SmolLM2-135M fp32"
    )
    print(f"# offline_cpu  {header}")

    ours_time, ours_tokens = tandem_throughput(prompts)
    rows = [("tandem LLM.generate", ours_time, ours_tokens)]
    if not args.skip_hf:
        rows.append(("HF generate (one padded batch)", *hf_throughput(prompts)))
    print(f"\n## Throughput: {args.num_prompts} prompts of 32-512 tokens, {NEW_TOKENS} new each")
    print("| engine | seconds | output tok/s | tandem speed-up |")
    print("|---|---:|---:|---:|")
    for name, seconds, tokens in rows:
        speed_up = (ours_tokens / ours_time) / (tokens / seconds)
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:.1f} | {speed_up:.2f}× |")

    print("\n## Stutter: 8 decode streams, then a 1,500-token prompt arrives")
    print("| policy | token budget | streams' median gap before | streams' max gap after | "
          "long prompt TTFT |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for policy, budget in [("decode-first", 2048), ("decode-first", 512), ("prefill-first", 2048)]:
        max_gap, median_gap, ttft = stutter(policy, budget, vocab)
        print(f"| {policy} | {budget} | {median_gap * 1e3:.0f} ms | {max_gap * 1e3:.0f} ms | "
              f"{ttft * 1e3:.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
