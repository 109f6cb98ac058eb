"""The step loop's own cost per running request (issue 13, items 1 and 2). The model is a
stand-in for a device: a tiny Llama whose forward is replaced by a device step of --device-ms
(a sleep, which releases the GIL) returning the same logits each step, so what is timed is
tandem's own work: scheduling, input preparation, sampling bookkeeping, recording the tokens,
building outputs.

1. Device time 0: for 16 to 1,024 running decodes, the engine core's step (what the server's
   core process runs) per running request, and the front end's output processing per request
   (the API process's work in the server). Target: <= 3 us per running request. The
   sampler's arithmetic runs on the stand-in device (as part 2's does, and as a GPU's does),
   and the steps inside gc_policy.step_loop_gc, as the engine-core process runs them; two more
   columns time the step with the sampler on the host, and at CPython's default collector
   thresholds, one with prompts of LONG_CONTEXT tokens and more (a step's work must not grow
   with what the requests hold), and one with every request sampled at a chat server's
   temperature and top-p by the sampler on the host. Prompt lengths are staggered over a
   block, as a server's are, so that each step a sixteenth of the requests fills a block.
2. Device time --device-ms, sampling included (as on a GPU, where it is kernels behind the
   forward), the device asynchronous as a CUDA stream is (StandInDevice): steps per second
   with async scheduling off and on, as a share of 1 / device time. Target: within 5% with it
   on, at 256 running.
3. With --embedded-model ROUNDS: the embedded model on this CPU (a real forward, using every
   core), output tok/s at batch 1 and 32 with async scheduling off and on.

    .venv/bin/python benchmarks/step_overhead.py [--steps 100] [--device-ms 10] [--step-loop-only]
        [--embedded-model ROUNDS]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem import LLM, SamplingParams
from tandem.engine import engine_core
from tandem.engine.gc_policy import step_loop_gc
from tandem.worker.sampler import SamplerOutput, SamplingInputs

RUNNING = (16, 64, 256, 1024)
GREEDY = SamplingParams(temperature=0)
# The last column of part 1: random sampling as a chat server's (the sampler on the host).
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
LONG_CONTEXT = 1000  # tokens of the shortest prompt, for the last column of part 1
BATCHED_TOKENS = 16384  # the engine's max_num_batched_tokens: a long-context setup is short
WARM_UP_STEPS = 3
BLOCK_SIZE = 16  # the engine's default


def tiny_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                         max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


class StandInDevice:
    """A device whose steps each take `seconds` and run one after another without holding the
    host, as a CUDA stream does: a launch queues a step behind the previous one, and the host
    waits only when it reads a result (completion_event)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.free_at = 0.0  # when the last queued step is done (perf_counter)

    def launch(self) -> None:
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds

    def completion_event(self) -> StandInEvent:
        return StandInEvent(self.free_at)


class StandInEvent:
    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))


def stand_in_engine(
    folder: Path,
    running: int,
    device_seconds: float,
    steps: int,
    prompt_len: int = 8,
    sampling: SamplingParams = GREEDY,
    **kwargs,
) -> LLM:
    """An engine with `running` requests of prompts of `prompt_len` to `prompt_len` + 15
    tokens, all decoding with `sampling` (its max_tokens and ignore_eos aside: they run on),
    with KV blocks for `steps` more steps, on a device that takes `device_seconds` per forward
    and returns the same logits every step (each row a fixed draw of N(0, 4²), peaked as a
    language model's are, so that top-p finds its cut where it does on real text). The
    lengths are staggered as a server's are: each step a sixteenth of the requests fills a
    block (a new one, the full one hashed into the prefix cache), not all of them one step in
    sixteen. With async scheduling the device runs
    asynchronously (StandInDevice); without, the forward blocks for it, as reading the
    sampled ids right after the launch does on a GPU."""
    # Each request's tokens by the end: its prompt, what it decodes while the later prompts
    # are admitted (a step admits BATCHED_TOKENS of them), the warm-up and the timed steps.
    longest_prompt = prompt_len + BLOCK_SIZE - 1
    num_admission_steps = -(-running * longest_prompt // BATCHED_TOKENS) + 1
    num_tokens = longest_prompt + num_admission_steps + WARM_UP_STEPS + steps + 1
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, max_num_seqs=running,
              max_num_batched_tokens=BATCHED_TOKENS, block_size=BLOCK_SIZE,
              num_kv_blocks=running * -(-num_tokens // BLOCK_SIZE), **kwargs)  # fmt: skip
    engine, core = llm.llm_engine, llm.engine.core
    model = core.runner.model
    # The device's output buffers: what it computes costs the host nothing.
    hidden = torch.zeros(BATCHED_TOKENS, model.config.hidden_size)
    logits = 4 * torch.randn(running, model.config.vocab_size,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
    device = StandInDevice(device_seconds)

    def device_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if core.async_scheduling:
            device.launch()
        elif device_seconds:
            time.sleep(device_seconds)
        return hidden[: len(input_ids)]

    model.forward = device_forward
    model.compute_logits = lambda rows: logits[: len(rows)]
    if core.async_scheduling:
        core.runner.completion_event = device.completion_event
    params = dataclasses.replace(sampling, max_tokens=10_000, ignore_eos=True)
    vocab_size = model.config.vocab_size
    for index in range(running):
        # Prompts differ in their first two tokens: no request shares another's blocks.
        first, second = divmod(index, vocab_size - 1)
        prompt = [second + 1, first + 1, *range(2, prompt_len + index % BLOCK_SIZE)]
        engine.add_request(str(index), prompt, params)
    while core.scheduler.num_running < running or core.scheduler.num_waiting:
        engine.step()
    for _ in range(WARM_UP_STEPS):
        engine.step()  # every request is decoding now (the one in flight too)
    return llm


@dataclass
class LoopCost:
    """Microseconds per running request per step."""

    core_fastest: float  # the engine core's, in the fastest round of 10 steps
    core_mean: float  # the engine core's, over every step (collections included)
    front_end: float  # the output processor's, in the fastest round


def step_loop_costs(
    folder: Path,
    running: int,
    steps: int,
    variants: dict[str, tuple[bool, int, SamplingParams]],
    tuned_gc: bool = True,
) -> dict[str, LoopCost]:
    """The engine core's cost (and the front end's) per running request per step, as the
    fastest round of 10 steps (this machine is shared, and what is wanted is the cost, not the
    neighbours' load) and as the mean over all steps (what a long run pays, the collector's
    runs included), for each variant: name -> (sample_on_device, prompt_len, sampling). Each
    variant is
    an engine of its own, their rounds taken in turn, so that a slow spell of the machine
    falls on all of them. `sample_on_device`: the sampler's arithmetic (an argmax over the
    vocabulary of every row) is the stand-in device's, as it is a GPU's; the host still builds
    the sampling inputs and records the tokens. `tuned_gc`: the steps run inside
    gc_policy.step_loop_gc, as the engine-core process's and LLM.generate's do; otherwise at
    CPython's default thresholds (then run one variant alone: the collector's full passes
    traverse every live engine)."""
    timers = {
        name: RoundTimer(
            stand_in_engine(folder, running, 0.0, steps, prompt_len, sampling).llm_engine
        )
        for name, (_, prompt_len, sampling) in variants.items()
    }
    host_sample = engine_core.sample
    try:
        with step_loop_gc() if tuned_gc else contextlib.nullcontext():
            for _ in range(max(1, steps // 10)):
                for name, (sample_on_device, _, _) in variants.items():
                    engine_core.sample = device_sample if sample_on_device else host_sample
                    timers[name].run_round()
    finally:
        engine_core.sample = host_sample
    return {name: timer.cost(running) for name, timer in timers.items()}


class RoundTimer:
    """Times an engine's steps in rounds of 10: the core's time, and the front end's (its
    output processing) apart."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rounds: list[tuple[float, float]] = []  # (core seconds, front end seconds)
        self._in_front_end = 0.0
        process_outputs = engine.processor.process_outputs

        def timed_process_outputs(outputs):
            start = time.perf_counter()
            try:
                return process_outputs(outputs)
            finally:
                self._in_front_end += time.perf_counter() - start

        engine.processor.process_outputs = timed_process_outputs

    def run_round(self) -> None:
        self._in_front_end = 0.0
        start = time.perf_counter()
        for _ in range(10):
            self.engine.step()
        elapsed = time.perf_counter() - start
        self.rounds.append((elapsed - self._in_front_end, self._in_front_end))

    def cost(self, running: int) -> LoopCost:
        per_request = 1e6 / (10 * running)
        core, front_end = min(self.rounds)
        mean = statistics.mean(core for core, _ in self.rounds)
        return LoopCost(core * per_request, mean * per_request, front_end * per_request)


def device_sample(logits: torch.Tensor, inputs: SamplingInputs) -> SamplerOutput:
    """Sampling as the stand-in device does it: within the device time (on a GPU it is
    kernels queued behind the forward)."""
    return SamplerOutput(torch.zeros(len(logits), dtype=torch.long), None)


def steps_per_second(
    folder: Path, running: int, steps: int, device_seconds: float, async_scheduling: bool
) -> float:
    llm = stand_in_engine(folder, running, device_seconds, steps, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    host_sample, engine_core.sample = engine_core.sample, device_sample
    try:
        with step_loop_gc():  # as the engine-core process runs
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            return steps / (time.perf_counter() - start)
    finally:
        engine_core.sample = host_sample


def embedded_model_rates(rounds: int) -> dict[tuple[bool, int], list[float]]:
    """Output tok/s of the embedded model (dtype auto) with async scheduling off and on, at
    batch 1 and 32 (128 new tokens each), the two modes alternating round by round."""
    prompts = [f"Write a long story about a lighthouse keeper, part {i}." for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    engines = {mode: LLM("default", async_scheduling=mode) for mode in (False, True)}
    rates: dict[tuple[bool, int], list[float]] = {}
    for _ in range(rounds):
        for batch in (1, 32):
            for mode, llm in engines.items():
                llm.generate(prompts[:1], params, use_tqdm=False)  # warm
                start = time.perf_counter()
                llm.generate(prompts[:batch], params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                rates.setdefault((mode, batch), []).append(batch * 128 / elapsed)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100,
                        help="timed steps per engine (rounds of 10)")  # fmt: skip
    parser.add_argument("--device-ms", type=float, default=10.0,
                        help="the stand-in device's time per step, part 2")  # fmt: skip
    parser.add_argument("--embedded-model", type=int, default=0, metavar="ROUNDS",
                        help="part 3: the embedded model, async off and on")  # fmt: skip
    parser.add_argument("--step-loop-only", action="store_true",
                        help="part 1 only (runs on engines without async scheduling)")  # fmt: skip
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(f"# step_overhead  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  "
          f"{torch.get_num_threads()} threads  commit {commit}")  # fmt: skip
    print("Columns 2-5: sampling's arithmetic on the stand-in device, the step loop inside "
          "gc_policy.step_loop_gc (as in the engine-core process and LLM.generate). Column 6: "
          "the sampler's argmax over the tiny model's 1,024-token vocabulary on the host. "
          "Column 7: CPython's default collector thresholds. Column 8: every request's "
          f"prompts of {LONG_CONTEXT}-{LONG_CONTEXT + BLOCK_SIZE - 1} tokens (the others: "
          f"8-{7 + BLOCK_SIZE}), plus the steps run. Column 9: every request sampled at "
          f"temperature {SAMPLED.temperature}, top-p {SAMPLED.top_p}, by the sampler on the "
          "host.")  # fmt: skip
    print("| running requests | core step ms | core µs per request | core µs per request, mean "
          "of all steps | front end µs per request | core µs, sampling on the host | core µs, "
          f"mean, default GC | core µs, {LONG_CONTEXT}+-token contexts | core µs, sampled on "
          "the host |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_model(Path(folder))
        for running in RUNNING:
            default_gc = step_loop_costs(
                model, running, args.steps, {"default GC": (True, 8, GREEDY)}, tuned_gc=False
            )["default GC"]
            costs = step_loop_costs(
                model, running, args.steps,
                {"device": (True, 8, GREEDY), "host": (False, 8, GREEDY),
                 "long": (True, LONG_CONTEXT, GREEDY)},
            )  # fmt: skip
            # Alone, as the default-GC engine: a fourth engine taking its rounds between the
            # others' would push their code and data out of the caches too (+10-15% at 1,024).
            sampled = step_loop_costs(model, running, args.steps, {"sampled": (False, 8, SAMPLED)})[
                "sampled"
            ]
            cost, host, long = costs["device"], costs["host"], costs["long"]
            print(f"| {running} | {cost.core_fastest * running / 1000:.2f} | "
                  f"{cost.core_fastest:.1f} | {cost.core_mean:.1f} | {cost.front_end:.1f} | "
                  f"{host.core_fastest:.1f} | {default_gc.core_mean:.1f} | "
                  f"{long.core_fastest:.1f} | {sampled.core_fastest:.1f} |")  # fmt: skip
        if args.step_loop_only:
            return
        ideal = 1000 / args.device_ms
        start = time.perf_counter()
        for _ in range(args.steps):
            time.sleep(args.device_ms / 1000)
        alone = args.steps / (time.perf_counter() - start)
        print(f"\nStand-in device, {args.device_ms:g} ms per step: steps/s (share of {ideal:.0f}); "
              f"its sleeps alone, no engine: {alone:.1f} ({alone / ideal:.0%})")  # fmt: skip
        print("| running requests | async scheduling off | on |")
        print("|---:|---:|---:|")
        for running in RUNNING:
            rates = [
                steps_per_second(model, running, args.steps, args.device_ms / 1000, mode)
                for mode in (False, True)
            ]
            print(f"| {running} | " + " | ".join(f"{r:.1f} ({r / ideal:.0%})" for r in rates)
                  + " |")  # fmt: skip
    if args.embedded_model:
        rates = embedded_model_rates(args.embedded_model)
        print("\nEmbedded model, dtype auto, this CPU: output tok/s, median of "
              f"{args.embedded_model} rounds")  # fmt: skip
        print("| batch | async scheduling off | on | on / off |")
        print("|---:|---:|---:|---:|")
        for batch in (1, 32):
            off, on = (statistics.median(rates[(mode, batch)]) for mode in (False, True))
            print(f"| {batch} | {off:.1f} | {on:.1f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
