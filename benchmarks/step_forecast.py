"""How well the step-cost model forecasts each step's time (issue 9, item 2; target on this CPU:
median absolute error <= 10%, p90 <= 20% over the stutter and random workloads), from step logs.

1. Unless --logs are given, servers started one at a time (`tandem serve --step-log`, the
   default engine: dtype auto), each alone on the machine, run the stutter workload (8 streams
   decoding, 1,536-token prompts arriving), the same with `--target-itl-ms` (where the
   scheduler sizes prompt chunks by the forecast), and the random workload; the step logs go
   to benchmarks/results/step_forecast/. A run of the streams alone first measures their pace,
   which sizes the stutter's streams (they decode until after the last prompt arrives: at a
   fixed 160 tokens the default engine's streams ended before the first came); streams of
   that length alone set the target at 1.5x their pace, as benchmarks/itl_target.py does.
2. Every log is scored twice over its steps after the first SKIP_STEPS (the model's unfitted
   start): the forecasts the engine logged (`predicted_step_time`, each made before the step
   it forecasts ran), and those of this tree's StepCostModel replaying the log from its first
   step (the same compositions and times, in order). For logs written by the same model the
   two agree (the script counts the steps where they do: a log from another model, or from an
   engine with another packed_max_tokens, agrees at fewer), which checks the replay; a change
   to the model is then judged on the very steps the old one forecast, free of this machine's
   run-to-run noise. The model's shape (the default model's) and peaks only shape the
   forecasts before its first fit, which are not scored.

    .venv/bin/python benchmarks/step_forecast.py [--logs A.jsonl ...] [--packed-max-tokens N]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

from serve_workloads import (
    KV_CACHE,
    SIZES,
    STREAM_TOKENS_ALONE,
    bench,
    covering_stream_tokens,
    serve,
    stutter_scenario,
)
from tandem.bench.launch import tandem_serve_command
from tandem.bench.report import percentile
from tandem.bench.runner import machine
from tandem.bench.step_plots import load_steps as read_step_log
from tandem.core.roofline import BatchSums, MachinePeaks, ModelShape
from tandem.core.step_cost import StepCostModel
from tandem.engine.cpu_formats import cpu_formats
from tandem.models.loader import load_model_config, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
SKIP_STEPS = 32
NUM_LONG = 3  # the stutter's long prompts


def streams_pace(out: Path, stream_tokens: int, label: str) -> float:
    """Seconds per token of the stutter's streams decoding alone, from each one's first token
    to its last (not the median gap: a multi-step burst's tokens arrive together)."""
    server = serve(tandem_serve_command(["--kv-cache-memory", KV_CACHE]), out / f"{label}.log")
    try:
        run = bench(server, stutter_scenario(0, stream_tokens), None, label, out)
    finally:
        server.stop()
    return statistics.median(
        (r.end - r.chunks[0]) / (r.output_tokens - 1) for r in run["records"] if r.ok
    )


def write_logs(out: Path) -> list[Path]:
    # Short streams' pace sizes the scenario's streams; those alone set the target (their
    # steps slow as their contexts grow).
    tokens = covering_stream_tokens(NUM_LONG, streams_pace(out, STREAM_TOKENS_ALONE, "short"))
    seconds = streams_pace(out, tokens, "alone")
    target_ms = 1.5e3 * seconds
    print(f"streams of {tokens} tokens alone: {seconds * 1e3:.2f} ms a token -> target "
          f"{target_ms:.1f} ms", flush=True)  # fmt: skip
    runs = [
        ("stutter", [], stutter_scenario(NUM_LONG, tokens)),
        ("stutter-target", ["--target-itl-ms", f"{target_ms:.1f}"],
         stutter_scenario(NUM_LONG, tokens)),
        ("random", [], SIZES["random"][0]()),
    ]  # fmt: skip
    logs = []
    for label, flags, workload in runs:
        log = out / f"{label}.jsonl"
        log.unlink(missing_ok=True)
        command = tandem_serve_command(["--kv-cache-memory", KV_CACHE, "--step-log", str(log),
                                        *flags])  # fmt: skip
        server = serve(command, out / f"{label}.log")
        try:
            bench(server, workload, SIZES["random"][1] if label == "random" else None, label, out)
        finally:
            server.stop()
        logs.append(log)
    return logs


def load_steps(path: Path) -> list[dict]:
    steps = read_step_log(path)
    missing = [s["step"] for s in steps if "num_context" not in s]
    if missing:
        raise SystemExit(f"{path}: steps without their composition (num_context): written "
                         "before the step log carried it; write a new log")  # fmt: skip
    return steps


def replayed(steps: list[dict], packed_max_tokens: int) -> list[float]:
    """The forecast of each step by a StepCostModel that saw the steps before it."""
    shape = ModelShape.of(load_model_config(resolve_model_path("default")), 4, 4, 4,
                          (1, 1, packed_max_tokens))  # fmt: skip
    # The peaks shape only the forecasts before the first fit, which are not scored.
    model = StepCostModel(shape, MachinePeaks("replay", 1e11, 1e10))
    forecasts = []
    for step in steps:
        num_steps = step.get("num_steps", 1)  # multi-step scheduling's forwards, as the engine
        num_new = step["num_prefill_tokens"] + step["num_decode_tokens"] // num_steps
        sums = BatchSums(num_new, step["num_attended"], step["num_context"], step["num_sampled"])
        seconds = step["step_time"] - step["propose_time"]
        forecasts.append(model.observe(sums, seconds, num_steps=num_steps))
    return forecasts


def errors(steps: list[dict], forecasts: list[float]) -> dict[str, list[float]]:
    """Absolute relative errors after SKIP_STEPS, by phase and for all steps."""
    by_phase: dict[str, list[float]] = {"all": []}
    for step, forecast in list(zip(steps, forecasts, strict=True))[SKIP_STEPS:]:
        measured = step["step_time"] - step["propose_time"]
        if measured <= 0:
            continue
        error = abs(forecast - measured) / measured
        by_phase["all"].append(error)
        by_phase.setdefault(step["phase"], []).append(error)
    return by_phase


def summary(by_phase: dict[str, list[float]]) -> str:
    return "; ".join(
        f"{phase} ({len(values)}): {100 * statistics.median(values):.1f}% / "
        f"{100 * percentile(values, 90):.1f}%"
        for phase, values in by_phase.items()
        if values
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", type=Path, nargs="*", help="score these step logs instead")
    parser.add_argument("--packed-max-tokens", type=int, default=None,
                        help="the engine's (default: this machine's probe for the default "
                             "model, as the servers this script starts use)")  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results/step_forecast")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    logs = args.logs or write_logs(args.out_dir)
    packed_max_tokens = args.packed_max_tokens
    if packed_max_tokens is None:
        config = load_model_config(resolve_model_path("default"))
        packed_max_tokens = cpu_formats(config, packable=True).packed_max_tokens
    info = machine()
    print(f"\n{datetime.date.today()}, {info.get('cpu')}, {info['cores']} cores; "
          f"`{' '.join([Path(sys.executable).name, *sys.argv])}`; median / p90 absolute error "
          f"after the first {SKIP_STEPS} steps, by phase (steps)\n")  # fmt: skip
    pooled: dict[str, dict[str, list[float]]] = {"logged": {}, "replayed": {}}
    for log in logs:
        steps = load_steps(log)
        logged = [s["predicted_step_time"] for s in steps]
        forecasts = replayed(steps, packed_max_tokens)
        scored = {"logged": errors(steps, logged), "replayed": errors(steps, forecasts)}
        num_same = sum(
            abs(a - b) <= 1e-9 * max(abs(a), 1e-9)
            for a, b in list(zip(logged, forecasts, strict=True))[SKIP_STEPS:]
        )
        print(f"{log.name}: replayed = logged at {num_same} of {len(steps) - SKIP_STEPS} "
              "scored steps (all of them where this model wrote the log)")  # fmt: skip
        for kind, by_phase in scored.items():
            print(f"{log.name}, {kind}: {summary(by_phase)}")
            for phase, values in by_phase.items():
                pooled[kind].setdefault(phase, []).extend(values)
    for kind, by_phase in pooled.items():
        print(f"all logs, {kind}: {summary(by_phase)}")


if __name__ == "__main__":
    main()
