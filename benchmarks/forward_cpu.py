"""Forward-pass speed on CPU: tandem's model runner against HF transformers in the same run.

SmolLM2-135M fp32 (the embedded GGUF, dequantized by each side): a 512-token prefill, and
batch-1 / batch-32 decode steps over a grown KV cache. Measurements alternate between the two
engines and report the best of N runs: the host is shared, and noise only ever adds time.

    .venv/bin/python benchmarks/forward_cpu.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tandem.models.loader import resolve_model_path
from tandem.worker.model_runner import ModelRunner, RunnerConfig

PREFILL_TOKENS = 512
DECODE_CONTEXT = 256
DECODE_STEPS = 16


@dataclass
class Slice:
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]


def tandem_prefill(runner: ModelRunner, prompt: list[int]) -> Callable[[], None]:
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    return lambda: runner.execute([Slice(prompt, 0, len(prompt), blocks)])


def tandem_decode(runner: ModelRunner, batch: int, vocab: int) -> Callable[[], None]:
    """Prefill `batch` sequences of DECODE_CONTEXT tokens, then time DECODE_STEPS steps."""
    total = DECODE_CONTEXT + DECODE_STEPS
    blocks_each = -(-total // runner.block_size)

    def run() -> None:
        slices = [
            Slice(
                [(7 * i + j) % vocab for j in range(total)],
                0,
                DECODE_CONTEXT,
                list(range(i * blocks_each, (i + 1) * blocks_each)),
            )
            for i in range(batch)
        ]
        runner.execute(slices)
        for s in slices:
            s.num_computed_tokens, s.num_new_tokens = DECODE_CONTEXT, 1
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            runner.execute(slices)
            for s in slices:
                s.num_computed_tokens += 1
        run.step_time = (time.perf_counter() - start) / DECODE_STEPS

    return run


def hf_prefill(model: torch.nn.Module, prompt: list[int]) -> Callable[[], None]:
    ids = torch.tensor([prompt])
    # logits_to_keep=1: what HF's own generate() asks for, so neither side pays the full head.
    return lambda: model(ids, logits_to_keep=1, use_cache=True)


def hf_decode(model: torch.nn.Module, batch: int, vocab: int) -> Callable[[], None]:
    total = DECODE_CONTEXT + DECODE_STEPS
    tokens = torch.tensor([[(7 * i + j) % vocab for j in range(total)] for i in range(batch)])

    def run() -> None:
        cache = DynamicCache()
        model(tokens[:, :DECODE_CONTEXT], past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for step in range(DECODE_STEPS):
            position = DECODE_CONTEXT + step
            model(
                tokens[:, position : position + 1],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        run.step_time = (time.perf_counter() - start) / DECODE_STEPS

    return run


def run_time(fn: Callable[[], None], uses_step_time: bool) -> float:
    """Seconds of one run: its whole call, or the per-step time the decode runs record."""
    start = time.perf_counter()
    fn()
    return fn.step_time if uses_step_time else time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    path = resolve_model_path("default")
    runner = ModelRunner(RunnerConfig(model=path, num_kv_blocks=32 * 20))
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    vocab = runner.model_config.vocab_size
    prompt = [(13 * j) % vocab for j in range(PREFILL_TOKENS)]

    cases = [
        ("prefill 512 tokens", PREFILL_TOKENS, False,
         tandem_prefill(runner, prompt), hf_prefill(hf, prompt)),
        ("decode step, batch 1", 1, True,
         tandem_decode(runner, 1, vocab), hf_decode(hf, 1, vocab)),
        ("decode step, batch 32", 32, True,
         tandem_decode(runner, 32, vocab), hf_decode(hf, 32, vocab)),
    ]  # fmt: skip
    rows = []
    with torch.inference_mode():
        for name, tokens, per_step, ours, theirs in cases:
            ours()  # warm-up
            theirs()
            ours_times, theirs_times = [], []
            for _ in range(args.repeats):  # alternate, so load on the machine hits both
                ours_times.append(run_time(ours, per_step))
                theirs_times.append(run_time(theirs, per_step))
            ours_s, theirs_s = min(ours_times), min(theirs_times)
            rows.append((name, ours_s, theirs_s, tokens))

    print(
        f"# forward_cpu  {datetime.date.today()}  {platform.machine()}  "
        f"{torch.get_num_threads()} threads  torch {torch.__version__}  SmolLM2-135M fp32"
    )
    print("| case | tandem ms | HF ms | tandem tok/s | HF tok/s | tandem speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ours_s, theirs_s, tokens in rows:
        print(
            f"| {name} | {ours_s * 1e3:.1f} | {theirs_s * 1e3:.1f} | {tokens / ours_s:.0f} | "
            f"{tokens / theirs_s:.0f} | {theirs_s / ours_s:.2f}× |"
        )


if __name__ == "__main__":
    main()
