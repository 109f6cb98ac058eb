"""What sampling parameters cost over greedy on the embedded model (issue 13, item 3): the
sampler's time per step for each mix of temperature / top-k / top-p / min-p at batch 1, 32
and 256, as the engine samples (the C kernel on CPU), and in torch ops (the path on GPUs and
without a compiler) with top-p found among the top candidates or by a full-vocabulary sort,
as a share of that batch's greedy decode step (measured in the same run).

    .venv/bin/python benchmarks/sampling_cpu.py [--dtype auto]

--dtype: the engine's weights for the greedy step the shares are taken of (default auto, the
engine's default; the runs before 2026-12-01 used float32, whose steps are slower).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from unittest import mock

import torch

from tandem import LLM, SamplingParams
from tandem.models.loader import resolve_model_path
from tandem.worker import sampler
from tandem.worker.sampler import SamplingInputs, sample

BATCHES = (1, 32, 256)
MIXES = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "top_p 0.95 + top_k 100 + min_p 0.02": dict(temperature=0.8, top_p=0.95, top_k=100, min_p=0.02),
}
REPEATS = 20


def sampler_ms(logits: torch.Tensor, params: SamplingParams) -> float:
    rows = logits.shape[0]
    inputs = SamplingInputs([params] * rows, [[1]] * rows, [[]] * rows, [None] * rows, [[]] * rows)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        sample(logits.clone(), inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def model_logits(llm: LLM) -> torch.Tensor:
    """Next-token logits of the embedded model (through HF transformers, the reference) at
    every position of some ordinary English: what a sampler really sees, peaked with a long
    tail."""
    from transformers import AutoModelForCausalLM

    text = (
        "The history of tea begins in China, where it was first drunk as a medicine. Traders "
        "carried it along the Silk Road, and by the seventeenth century it had reached Europe. "
        "Bridges carry load by turning it into tension and compression; a suspension bridge "
        "hangs its deck from cables, while an arch pushes outward against its abutments. "
    ) * 3
    path = resolve_model_path("default")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    token_ids = llm.get_tokenizer()(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(token_ids).logits[0].float()


def decode_step_ms(llm: LLM, batch: int) -> float:
    """The median decode forward of `batch` greedy requests over a 64-token context (a
    multi-step burst's step time over its forwards: each forward samples once)."""
    prompts = [{"prompt_token_ids": [1000 + (i * 7 + j) % 20000 for j in range(64)]}
               for i in range(batch)]  # fmt: skip
    core = llm.llm_engine.core
    core.step_stats.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    return (
        statistics.median(
            s.step_time / s.num_steps
            for s in core.step_stats
            if s.num_decode_tokens and not s.num_prefill_tokens
        )
        * 1e3
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM("default", dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=16384)
    vocab = llm.llm_engine.core.runner.model_config.vocab_size
    real_logits = model_logits(llm)
    generator = torch.Generator().manual_seed(0)
    print(f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, vocab {vocab}, "
          f"dtype {args.dtype}")  # fmt: skip
    print("| batch | greedy step | mix | sampler | over greedy | torch ops (candidates) | over "
          "greedy | torch ops (full sort) | over greedy |")  # fmt: skip
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")

    def sorted_floor(logits, top, k, p, min_floor=None):  # the sort-based oracle
        return sampler._top_k_top_p_floor_sorted(logits, k, p, min_floor)

    for batch in BATCHES:
        step = decode_step_ms(llm, batch)
        logits = real_logits[torch.randint(0, len(real_logits), (batch,), generator=generator)]
        greedy = sampler_ms(logits, SamplingParams(**MIXES["greedy"]))
        for name, fields in MIXES.items():
            params = SamplingParams(**fields)
            engine = sampler_ms(logits, params)  # as the engine samples: the C kernel on CPU
            with mock.patch.object(sampler, "_kernel_rows", lambda logits, inputs: []):
                torch_ops = sampler_ms(logits, params)
                with mock.patch.object(sampler, "_top_k_top_p_floor", sorted_floor):
                    full = sampler_ms(logits, params)
            shares = [(ms - greedy) / step for ms in (engine, torch_ops, full)]
            print(f"| {batch} | {step:.1f} ms | {name} | {engine:.2f} ms | {shares[0]:+.1%} | "
                  f"{torch_ops:.2f} ms | {shares[1]:+.1%} | {full:.2f} ms | {shares[2]:+.1%} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
