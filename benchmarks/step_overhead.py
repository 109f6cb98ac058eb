"""The step loop's own cost per running request (issue 13, items 1 and 2), with a tiny 2-layer
model so the forward is nearly free.

1. For 16 to 1,024 running decodes, the wall time of an engine step, the part spent in the
   runner (input preparation and forward), and what remains per request (scheduling, sampling
   bookkeeping, output building). Target: <= 3 us per running request.
2. A stand-in for a GPU: the forward replaced by a sleep of --device-ms (releasing the GIL, as
   a CUDA stream runs without the host) returning constant logits. Steps per second with async
   scheduling off and on, as a share of 1 / device time. Target: within 5% with it on.

    .venv/bin/python benchmarks/step_overhead.py [--steps 20] [--device-ms 10]
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
from tandem.worker.model_runner import RunnerOutput

RUNNING = (16, 64, 256, 1024)


def tiny_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                         max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def decoding_engine(folder: Path, running: int, async_scheduling: bool = False) -> LLM:
    """An engine with `running` requests, all decoding."""
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_num_seqs=running,
              max_num_batched_tokens=max(2048, running), num_kv_blocks=running * 4 + 64,
              enable_prefix_caching=False, async_scheduling=async_scheduling)  # fmt: skip
    engine, core = llm.llm_engine, llm.engine.core
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for index in range(running):
        engine.add_request(str(index), list(range(1, 9)), params)
    while core.scheduler.num_running < running or core.scheduler.num_waiting:
        engine.step()
    for _ in range(2):
        engine.step()  # every request is decoding now (the one in flight too)
    return llm


def measure(folder: Path, running: int, steps: int) -> dict[str, float]:
    llm = decoding_engine(folder, running)
    engine, core = llm.llm_engine, llm.engine.core
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


def stand_in_steps_per_second(
    folder: Path, running: int, steps: int, device_seconds: float, async_scheduling: bool
) -> float:
    """Steps per second with the forward replaced by a device that takes `device_seconds`."""
    llm = decoding_engine(folder, running, async_scheduling)
    engine, core = llm.llm_engine, llm.engine.core
    vocab_size = core.runner.model_config.vocab_size

    def device_forward(batch, num_prompt_top=0, placeholder_token_ids=None) -> RunnerOutput:
        if batch.placeholder_indices is not None:
            batch.input_ids[batch.placeholder_indices] = placeholder_token_ids
        time.sleep(device_seconds)
        return RunnerOutput(torch.zeros(len(batch.logits_indices), vocab_size))

    core.runner.forward = device_forward
    for _ in range(2):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device-ms", type=float, default=10.0,
                        help="the stand-in device's time per step")  # fmt: skip
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
        ideal = 1000 / args.device_ms
        print(f"\nStand-in device, {args.device_ms:g} ms per step: steps/s (share of {ideal:.0f})")
        print("| running requests | async scheduling off | on |")
        print("|---:|---:|---:|")
        for running in RUNNING:
            device_seconds = args.device_ms / 1000
            rates = [
                stand_in_steps_per_second(model, running, args.steps * 3, device_seconds, mode)
                for mode in (False, True)
            ]
            print(f"| {running} | " + " | ".join(f"{r:.1f} ({r / ideal:.0%})" for r in rates)
                  + " |")  # fmt: skip


if __name__ == "__main__":
    main()
