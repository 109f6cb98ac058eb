"""CPU speed of the embedded model (issue 10): tandem's dtype="auto" and each explicit dtype
against HF transformers fp32, in one run, alternating round by round.

Rows: prefill of 512 tokens, batch-1 decode (tok/s), 32 prompts x 128 new tokens (output tok/s),
the offline 64-prompt workload (--offline), start-up (first start with an empty cache, then a
second), where a batch-1 decode step's time goes (forward against everything else), and the
auto mode's quality beside fp32: teacher-forced over a fixed text (the Python license, a few
thousand tokens), in prefill-sized and in decode-sized steps, top-1 agreement and perplexity.
Nothing else may compute meanwhile (two OpenMP processes on 2 cores slow each other 10-30x).

    .venv/bin/python benchmarks/cpu_speed.py [--rounds 3] [--offline] [--single-step]
        [--breakdown-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

import tandem.engine.engine_core as engine_core_module
import tandem.worker.model_runner as runner_module
from tandem import LLM, SamplingParams
from tandem.attention.metadata import build_batch
from tandem.core.scheduler import ScheduledRequest
from tandem.engine.config import EngineConfig
from tandem.engine.tokenizer import load_tokenizer
from tandem.models.loader import resolve_model_path
from tandem.worker.model_runner import ModelRunner, RunnerConfig

PREFILL_TOKENS = 512
NEW_TOKENS = 128
BATCH = 32
PROMPT_TOKENS = 32
KV_CACHE = 1 << 30
TANDEM_DTYPES = ("auto", "float32", "bfloat16")
RESULTS = Path("benchmarks/results/cpu_speed.json")


def random_tokens(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(17, 49152, (count, length), generator=generator).tolist()


class Tandem:
    def __init__(
        self,
        dtype: str,
        compilation_level: int = 0,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        num_scheduler_steps: int | None = None,
    ) -> None:
        self.name = f"tandem {dtype}" + (" compiled" if compilation_level else "")
        if attention_backend != "auto":
            self.name += f" ({attention_backend} attention)"
        if kv_cache_dtype != "auto":
            self.name += f" ({kv_cache_dtype} KV cache)"
        if num_scheduler_steps is not None:
            self.name += f" (num_scheduler_steps={num_scheduler_steps})"
        # No prefix caching: the same prompts run every round.
        self.llm = LLM(
            "default", dtype=dtype, kv_cache_memory=KV_CACHE, enable_prefix_caching=False,
            compilation_config=compilation_level, attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype, num_scheduler_steps=num_scheduler_steps,
        )  # fmt: skip

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    def prefill(self, prompt: list[int]) -> float:
        return self._generate([prompt], 1)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        return self._generate(prompts, max_tokens)


class HF:
    name = "HF fp32"

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path("default")
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(torch.tensor([prompt]), logits_to_keep=1)  # as generate's prefill
        return time.perf_counter() - start

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                torch.tensor(prompts),
                attention_mask=torch.ones(len(prompts), len(prompts[0])),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        return time.perf_counter() - start


def speed_rows(engines: list, rounds: int) -> dict[str, dict[str, float]]:
    """Best of `rounds` per engine and case; the engines take turns within each round."""
    (prefill_prompt,) = random_tokens(1, PREFILL_TOKENS, seed=1)
    (decode_prompt,) = random_tokens(1, PROMPT_TOKENS, seed=2)
    batch_prompts = random_tokens(BATCH, PROMPT_TOKENS, seed=3)
    best: dict[str, dict[str, float]] = defaultdict(dict)
    for engine in engines:  # warm-up: first-call kernel selection, allocations
        engine.prefill(prefill_prompt)
        engine.generate([decode_prompt], 4)
    for _ in range(rounds):
        for engine in engines:
            figures = {
                "prefill_s": engine.prefill(prefill_prompt),
                "decode_tok_s": NEW_TOKENS / engine.generate([decode_prompt], NEW_TOKENS),
                "batch_tok_s": BATCH * NEW_TOKENS / engine.generate(batch_prompts, NEW_TOKENS),
            }
            for case, value in figures.items():
                previous = best[engine.name].get(case)
                better = min if case.endswith("_s") and not case.endswith("tok_s") else max
                best[engine.name][case] = value if previous is None else better(previous, value)
    return dict(best)


def offline_rows(engines: list) -> dict[str, float]:
    """The offline workload of benchmarks/offline_cpu.py: 64 prompts of 32-512 tokens, 128 new
    tokens each (HF: one left-padded batch)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from offline_cpu import hf_throughput, random_prompts

    prompts = random_prompts(64, 32, 512, 49152)
    rates = {}
    for engine in engines:
        if isinstance(engine, HF):
            seconds, tokens = hf_throughput(prompts)
        else:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            start = time.perf_counter()
            engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds, tokens = time.perf_counter() - start, len(prompts) * NEW_TOKENS
        rates[engine.name] = tokens / seconds
    return rates


def startup_seconds(dtype: str, compilation_level: int = 0) -> tuple[float, float]:
    """Wall time of a fresh process to a ready LLM: with an empty tandem cache, then again.
    Compiled: until a prefill and a decode step have run (torch.compile compiles lazily)."""
    code = (
        f"from tandem import LLM, SamplingParams; llm = LLM('default', dtype={dtype!r}, "
        f"kv_cache_memory={KV_CACHE}, compilation_config={compilation_level})"
    )
    if compilation_level:
        code += "; llm.generate('Hello ' * 20, SamplingParams(max_tokens=2), use_tqdm=False)"
    with tempfile.TemporaryDirectory() as cache:
        # Inductor's cache lives in tandem's (unless set): this process's must not leak in.
        env = {**os.environ, "TANDEM_CACHE_DIR": cache}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
    return times[0], times[1]


def step_breakdown(engine: Tandem, rounds: int) -> dict[str, float]:
    """Milliseconds per step of a batch-1 decode: input preparation, the forward (with the
    logits), sampling, the engine core's other work, and the front end's (output processing,
    detokenizing), each the least of `rounds` generations. Timed by wrapping the functions
    the step calls (a multi-step burst's forwards, inside decode_steps, count as the forward;
    the parts are per token)."""
    runs = [_one_breakdown(engine) for _ in range(rounds)]
    return {part: min(run[part] for run in runs) for part in runs[0]}


def _one_breakdown(engine: Tandem) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)

    def timed(name: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return wrapper

    core = engine.llm.engine.core
    patches = [
        (runner_module, "build_batch", timed("input", runner_module.build_batch)),
        (engine_core_module, "sample", timed("sampling", engine_core_module.sample)),
        (core.runner, "run", timed("run", core.runner.run)),
        (core.runner, "decode_steps", timed("run", core.runner.decode_steps)),
        (core, "step", timed("step", core.step)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        (prompt,) = random_tokens(1, PROMPT_TOKENS, seed=4)
        num_steps = NEW_TOKENS
        wall = engine.generate([prompt], num_steps)
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
    per_step = {
        "input": totals["input"],
        "forward": totals["run"] - totals["input"],
        "sampling": totals["sampling"],
        "engine other": totals["step"] - totals["run"] - totals["sampling"],
        "front end": wall - totals["step"],
    }
    return {name: seconds / num_steps * 1e3 for name, seconds in per_step.items()}


def print_breakdown(engines: list[Tandem], rounds: int) -> dict[str, dict[str, float]]:
    breakdown = {engine.name: step_breakdown(engine, rounds) for engine in engines}
    print(f"\n## Batch-1 decode step, ms (share of the step), each part the least of {rounds}")
    parts = list(next(iter(breakdown.values())))
    print("| engine | " + " | ".join(parts) + " | non-forward share |")
    print("|---|" + "---:|" * (len(parts) + 1))
    for name, row in breakdown.items():
        total = sum(row.values())
        cells = " | ".join(f"{row[p]:.2f} ({row[p] / total:.0%})" for p in parts)
        print(f"| {name} | {cells} | {1 - row['forward'] / total:.1%} |")
    return breakdown


def reference_text_tokens(count: int) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return load_tokenizer(resolve_model_path("default")).encode(text)[:count]


def teacher_forced(runner: ModelRunner, tokens: list[int], chunk: int) -> tuple:
    """log p(next token) at every position and the argmax there, fed `chunk` tokens a step."""
    block_ids = list(range(-(-len(tokens) // runner.block_size)))
    logprobs, argmax = [], []
    with torch.inference_mode():
        for start in range(0, len(tokens) - 1, chunk):
            end = min(start + chunk, len(tokens) - 1)
            request = ScheduledRequest(
                "text", tokens[:end], start, end - start, block_ids, True, []
            )
            batch = build_batch([request], runner.block_size, runner.device)
            hidden = runner.hidden_states(batch)
            rows = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            logprobs.append(
                rows[torch.arange(end - start), torch.tensor(tokens[start + 1 : end + 1])]
            )
            argmax.append(rows.argmax(dim=-1))
    return torch.cat(logprobs), torch.cat(argmax)


def quality_rows(
    num_tokens: int, fp32_kv_cache: bool = False
) -> tuple[dict[str, dict[str, float]], dict]:
    """Top-1 agreement with fp32 and perplexity of the auto mode (and of plain bf16, and of
    auto over a float32 KV cache if asked), with prefill-sized steps (512 tokens) and
    decode-sized ones (16 tokens, or fewer where packed weights stop sooner)."""
    auto = EngineConfig.create("default", device="cpu").runner
    tokens = reference_text_tokens(num_tokens)
    blocks = -(-len(tokens) // 16) + 1
    auto_config = RunnerConfig(
        model="default",
        dtype=auto.dtype,
        num_kv_blocks=blocks,
        packed_max_tokens=auto.packed_max_tokens,
        packed_int8_min_tokens=auto.packed_int8_min_tokens,
        attention_backend=auto.attention_backend,
        kv_cache_dtype=auto.kv_cache_dtype,
    )
    runners = {
        "float32": ModelRunner(RunnerConfig(model="default", num_kv_blocks=blocks)),
        "bfloat16": ModelRunner(
            RunnerConfig(model="default", dtype="bfloat16", num_kv_blocks=blocks)
        ),
        "auto": ModelRunner(auto_config),
    }
    if fp32_kv_cache:
        runners["auto (float32 KV cache)"] = ModelRunner(
            replace(auto_config, kv_cache_dtype="float32")
        )
    # Decode-sized steps: 16 tokens of one request after its first step run on the fused decode
    # path as verification tokens, through the kernels a decode step uses, row by row.
    decode_chunk = min(auto.packed_max_tokens, 16) or 1
    reference_logprobs, reference_argmax = teacher_forced(runners["float32"], tokens, 512)
    reference_ppl = math.exp(-reference_logprobs.double().mean().item())
    rows = {"float32, 512-token steps": {"top1_same": 1.0, "perplexity": reference_ppl}}
    for name in list(runners)[1:]:
        for chunk in (512, decode_chunk):
            logprobs, argmax = teacher_forced(runners[name], tokens, chunk)
            rows[f"{name}, {chunk}-token steps"] = {
                "top1_same": (argmax == reference_argmax).double().mean().item(),
                "perplexity": math.exp(-logprobs.double().mean().item()),
            }
    return rows, {
        "dtype": auto.dtype,
        "packed_max_tokens": auto.packed_max_tokens,
        "packed_int8_min_tokens": auto.packed_int8_min_tokens,
        "kv_cache_dtype": str(runners["auto"].kv_cache_dtype).removeprefix("torch."),
        "num_tokens": len(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--offline", action="store_true", help="also the 64-prompt workload")
    parser.add_argument("--quality-tokens", type=int, default=3000)
    parser.add_argument("--compile", action="store_true",
                        help="also dtype='auto' with compilation_config=3")  # fmt: skip
    parser.add_argument("--torch-attention", action="store_true",
                        help="also dtype='auto' and 'float32' on the torch attention backend "
                        "(the gather + SDPA reference) beside the default")  # fmt: skip
    parser.add_argument("--fp32-kv-cache", action="store_true",
                        help="also dtype='auto' with kv_cache_dtype='float32' (auto's "
                             "is bfloat16 on CPU)")  # fmt: skip
    parser.add_argument("--speed-only", action="store_true",
                        help="only the speed rows (no breakdown, start-up or quality)")  # fmt: skip
    parser.add_argument("--single-step", action="store_true",
                        help="also dtype='auto' with one forward a step "
                        "(num_scheduler_steps=1: no multi-step bursts)")  # fmt: skip
    parser.add_argument("--breakdown-only", action="store_true",
                        help="only the batch-1 step's breakdown, tandem's engines")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", choices=TANDEM_DTYPES, default=TANDEM_DTYPES,
                        help="tandem's dtypes to run (bfloat16 is slow without native bf16 "
                        "matmuls, e.g. on AVX2-only CPUs)")  # fmt: skip
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# cpu_speed  {datetime.datetime.now():%Y-%m-%d %H:%M}  {platform.machine()}  "
        f"{torch.get_num_threads()} threads  torch {torch.__version__}  commit {commit}"
    )
    auto_config = EngineConfig.create("default", device="cpu")
    auto = auto_config.runner
    print(
        f"dtype='auto' here: {auto.dtype}, packed 4-bit weights for steps of at most "
        f"{auto.packed_max_tokens} tokens, int8 activations from "
        f"{auto.packed_int8_min_tokens or 'none'}; up to "
        f"{auto_config.scheduler.num_scheduler_steps} forwards a step of decodes alone"
    )

    single_step = [Tandem("auto", num_scheduler_steps=1)] if args.single_step else []
    if args.breakdown_only:
        print_breakdown([*(Tandem(dtype) for dtype in args.dtypes), *single_step], args.rounds)
        return
    engines = [HF(), *(Tandem(dtype) for dtype in args.dtypes), *single_step]
    if args.compile:
        engines.append(Tandem("auto", compilation_level=3))
    if args.torch_attention:
        engines += [Tandem(dtype, attention_backend="torch") for dtype in ("auto", "float32")]
    if args.fp32_kv_cache:
        engines.append(Tandem("auto", kv_cache_dtype="float32"))
    speed = speed_rows(engines, args.rounds)
    hf = speed[HF.name]
    print(f"\n## Speed (best of {args.rounds} alternated rounds)")
    print(
        "| engine | prefill 512 s | × HF | batch-1 decode tok/s | × HF | "
        f"{BATCH}×{NEW_TOKENS} tok/s | × HF |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in speed.items():
        print(
            f"| {name} | {row['prefill_s']:.3f} | {hf['prefill_s'] / row['prefill_s']:.2f}× | "
            f"{row['decode_tok_s']:.1f} | {row['decode_tok_s'] / hf['decode_tok_s']:.2f}× | "
            f"{row['batch_tok_s']:.1f} | {row['batch_tok_s'] / hf['batch_tok_s']:.2f}× |"
        )

    offline = offline_rows(engines) if args.offline else {}
    if offline:
        print("\n## Offline workload: 64 prompts of 32-512 tokens, 128 new each (output tok/s)")
        print("| engine | tok/s | × HF |")
        print("|---|---:|---:|")
        for name, rate in offline.items():
            print(f"| {name} | {rate:.1f} | {rate / offline[HF.name]:.2f}× |")
    if args.speed_only:
        return

    breakdown = print_breakdown(engines[1:], args.rounds)
    del engines

    startup = {dtype: startup_seconds(dtype) for dtype in args.dtypes}
    if args.compile:
        startup["auto compiled (to a first prefill and decode)"] = startup_seconds("auto", 3)
    print("\n## Start-up to a ready LLM (fresh process), s")
    print("| dtype | first start (empty cache) | second start |")
    print("|---|---:|---:|")
    for dtype, (first, second) in startup.items():
        print(f"| {dtype} | {first:.1f} | {second:.1f} |")

    quality, quality_setup = quality_rows(args.quality_tokens, args.fp32_kv_cache)
    print(
        f"\n## Quality beside fp32, teacher-forced over {quality_setup['num_tokens']} tokens of "
        "the Python license"
    )
    print("| mode, step size | top-1 same as fp32 | perplexity | × fp32 |")
    print("|---|---:|---:|---:|")
    reference = quality["float32, 512-token steps"]["perplexity"]
    for name, row in quality.items():
        print(
            f"| {name} | {row['top1_same']:.2%} | {row['perplexity']:.3f} | "
            f"{row['perplexity'] / reference:.4f} |"
        )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                "commit": commit,
                "threads": torch.get_num_threads(),
                "auto": {
                    "dtype": auto.dtype,
                    "packed_max_tokens": auto.packed_max_tokens,
                    "packed_int8_min_tokens": auto.packed_int8_min_tokens,
                },
                "speed": speed,
                "breakdown": breakdown,
                "offline": offline,
                "startup": startup,
                "quality": quality,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
