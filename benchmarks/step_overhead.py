"""The step loop's own cost per running request (issue 13, item 1), with a tiny 2-layer model so
the forward is nearly free: for 16 to 1,024 running decodes, the wall time of an engine step,
the part spent in the runner (input preparation and forward), and what remains per request
(scheduling, sampling bookkeeping, output building). Target: <= 3 us per running request.

    .venv/bin/python benchmarks/step_overhead.py [--steps 20]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tandem import LLM, SamplingParams

RUNNING = (16, 64, 256, 1024)


def tiny_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                         max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def measure(folder: Path, running: int, steps: int) -> dict[str, float]:
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_num_seqs=running,
              max_num_batched_tokens=max(2048, running), num_kv_blocks=running * 4 + 64,
              enable_prefix_caching=False)  # fmt: skip
    engine, core = llm.llm_engine, llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for index in range(running):
        engine.add_request(str(index), list(range(1, 9)), params)
    while core.scheduler.num_running < running or core.scheduler.num_waiting:
        engine.step()
    engine.step()  # every request is decoding now
    in_runner = 0.0
    run = core.runner.run

    def timed_run(*args, **kwargs):
        nonlocal in_runner
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            in_runner += time.perf_counter() - start

    core.runner.run = timed_run
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    in_runner /= steps
    return {"step_ms": wall * 1e3, "runner_ms": in_runner * 1e3,
            "per_request_us": (wall - in_runner) / running * 1e6}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(f"# step_overhead  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  "
          f"{torch.get_num_threads()} threads  commit {commit}")  # fmt: skip
    print("| running requests | step ms | runner ms (inputs + forward) | rest per request µs |")
    print("|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model(Path(folder))
        for running in RUNNING:
            row = measure(model, running, args.steps)
            print(f"| {running} | {row['step_ms']:.2f} | {row['runner_ms']:.2f} | "
                  f"{row['per_request_us']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
