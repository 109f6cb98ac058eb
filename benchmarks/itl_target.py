"""ITL-targeted decode-first against fixed token budgets (issue 9), in one run on this machine:

1. 8 streams decoding alone (the scenario's streams, below): their median inter-token gap
   is the decode step; the target is 1.5x it.
2. The stutter scenario (8 streams, a 1,536-token prompt every 3 s) under decode-first with
   budgets 256 / 512 / 2048, prefill-first (2048), and decode-first with --target-itl-ms:
   the streams' p99 and max gap, and the long prompts' TTFT. Goal: max gap <= 1.25x the
   target, long-prompt TTFT within 1.5x of prefill-first's. The streams are long enough to
   decode, at their own pace alone, until 3 s after the last prompt arrives (their length
   from a run of 160-token streams alone), so that every prompt arrives while they decode:
   with a fixed length the streams of a faster engine ended before the later prompts came,
   and those prompts' TTFT measured a prefill alone. The table says how many prompts got
   their first token while all 8 streams still decoded.
3. The telemetry's own cost per step (roofline count, forecast, model update) against the
   median step time. Goal: under 1%.

Each server starts alone; nothing else computes while one runs. Results (JSON, ITL plots, a
Markdown summary) go to benchmarks/results/itl_target/.

    .venv/bin/python benchmarks/itl_target.py [--long-prompts 3]
    .venv/bin/python benchmarks/itl_target.py --only-target MS   # that target's row alone

`--only-target MS` runs the stutter scenario under that target only (no streams-alone run, no
fixed budgets; the streams sized from a gap of MS / 1.5): for A/Bs of the scheduler at one
target, runs of two trees alternated.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from serve_workloads import (
    KV_CACHE,
    LONG_EVERY,
    LONG_START,
    STUTTER_STREAMS,
    bench,
    covering_stream_tokens,
    policy_flag,
    serve,
    stream_figures,
    stutter_scenario,
)
from tandem.bench import plots
from tandem.bench import workloads as w
from tandem.bench.launch import tandem_serve_command
from tandem.bench.runner import machine
from tandem.core.roofline import MachinePeaks, ModelShape, batch_sums, place_step, sums_work
from tandem.core.step_cost import StepCostModel
from tandem.models.loader import load_model_config, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]


def run_server(args: list[str], label: str, workload: w.Workload, out: Path) -> dict:
    server = serve(
        tandem_serve_command(["--kv-cache-memory", KV_CACHE, "--dtype", "float32", *args]),
        out / f"{label}.log",
    )
    try:
        run = bench(server, workload, None, label, out)
    finally:
        server.stop()
    plots.itl_timeline(run, out / f"{label.replace(' ', '_')}_itl.png", f"Stutter, tandem {label}")
    return run


class _Work:
    def __init__(self, computed: int, new: int, sample: bool) -> None:
        self.num_computed_tokens, self.num_new_tokens, self.sample = computed, new, sample
        self.draft_token_ids: tuple[int, ...] = ()


def telemetry_seconds_per_step() -> float:
    """What the engine adds to each step for telemetry: sums, roofline placement, forecast and
    model update, on a stutter-like batch (8 decodes over ~500 positions and a 256-token
    chunk), averaged over many steps with the model refitting as it does in the engine."""
    shape = ModelShape.of(load_model_config(resolve_model_path("default")), 4, 4, 4)
    model = StepCostModel(shape, MachinePeaks("probe", 2e11, 2e10))
    batch = [_Work(500 + i, 1, True) for i in range(STUTTER_STREAMS)] + [_Work(512, 256, False)]
    num_steps = 5000
    start = time.perf_counter()
    for index in range(num_steps):
        sums = batch_sums(batch)
        place_step(sums_work(shape, sums), 0.1, model.peaks)
        model.predict(sums)
        model.observe(sums, 0.1 + 1e-4 * (index % 7))
    return (time.perf_counter() - start) / num_steps


def _seconds(values_ms: list[float]) -> str:
    return ", ".join(f"{value / 1e3:.2f} s" for value in values_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results/itl_target")
    parser.add_argument("--only-target", type=float, metavar="MS")
    args = parser.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    flag = policy_flag()
    info = machine()
    if args.only_target:
        target_args = [flag, "decode-first", "--max-num-batched-tokens", "2048",
                       "--target-itl-ms", f"{args.only_target:.1f}"]  # fmt: skip
        label = f"target {args.only_target:.0f} ms"
        tokens = covering_stream_tokens(args.long_prompts, args.only_target / 1.5e3)
        f = stream_figures(
            run_server(target_args, label, stutter_scenario(args.long_prompts, tokens), out)
        )
        print(f"{label}, streams of {tokens} tokens: ITL p50 {f['itl_p50']:.0f} ms, p99 "
              f"{f['itl_p99']:.0f} ms, max {f['itl_max']:.0f} ms "
              f"({f['itl_max'] / args.only_target:.2f}x), long TTFT {f['long_ttft']:.0f} ms "
              f"({_seconds(f['long_ttfts'])}; {f['long_beside_streams']} beside the streams)",
              flush=True)  # fmt: skip
        return

    # Short streams alone give the pace that sizes the scenario's streams; streams of that
    # length alone give the decode step (their steps slow as their contexts grow).
    short = run_server([], "short streams alone", stutter_scenario(0), out)
    tokens = covering_stream_tokens(args.long_prompts, stream_figures(short)["itl_p50"] / 1e3)
    alone = run_server([], "streams alone", stutter_scenario(0, tokens), out)
    decode_step_ms = stream_figures(alone)["itl_p50"]
    target_ms = 1.5 * decode_step_ms
    print(f"streams of {tokens} tokens alone: median gap {decode_step_ms:.1f} ms -> target "
          f"{target_ms:.1f} ms")  # fmt: skip

    setups = [
        ("decode-first 256", [flag, "decode-first", "--max-num-batched-tokens", "256"]),
        ("decode-first 512", [flag, "decode-first", "--max-num-batched-tokens", "512"]),
        ("decode-first 2048", [flag, "decode-first", "--max-num-batched-tokens", "2048"]),
        ("prefill-first 2048", [flag, "prefill-first", "--max-num-batched-tokens", "2048"]),
        (
            f"target {target_ms:.0f} ms",
            [
                flag,
                "decode-first",
                "--max-num-batched-tokens",
                "2048",
                "--target-itl-ms",
                f"{target_ms:.1f}",
            ],
        ),
    ]
    figures = {}
    for label, server_args in setups:
        figures[label] = stream_figures(
            run_server(server_args, label, stutter_scenario(args.long_prompts, tokens), out)
        )
        f = figures[label]
        print(f"  {label}: p99 {f['itl_p99']:.0f} ms, max {f['itl_max']:.0f} ms, "
              f"long TTFT {f['long_ttft']:.0f} ms", flush=True)  # fmt: skip

    telemetry = telemetry_seconds_per_step()
    prefill_first_ttft = figures["prefill-first 2048"]["long_ttft"]
    lines = [
        f"# ITL target vs fixed budgets, {datetime.date.today()}",
        "",
        f"Machine: {info.get('cpu')}, {info['cores']} cores. Command: "
        f"`{' '.join([Path(sys.executable).name, *sys.argv])}`",
        "",
        f"{STUTTER_STREAMS} streams alone: median gap {decode_step_ms:.1f} ms; target "
        f"{target_ms:.1f} ms (1.5x). Stutter: {STUTTER_STREAMS} streams of {tokens} tokens, "
        f"{args.long_prompts} prompts of 1,536 tokens, one every {LONG_EVERY:.0f} s from "
        f"{LONG_START:.0f} s.",
        "",
        "| setup | streams' ITL p50 | p99 | max | max / target | long prompt TTFT p50 "
        "| TTFT / prefill-first's | each prompt's TTFT | prompts beside all streams |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, f in figures.items():
        lines.append(
            f"| {label} | {f['itl_p50']:.0f} ms | {f['itl_p99']:.0f} ms | {f['itl_max']:.0f} ms "
            f"| {f['itl_max'] / target_ms:.2f}x | {f['long_ttft']:.0f} ms "
            f"| {f['long_ttft'] / prefill_first_ttft:.2f}x | {_seconds(f['long_ttfts'])} "
            f"| {f['long_beside_streams']} of {len(f['long_ttfts'])} |"
        )
    lines += [
        "",
        f"Telemetry per step: {telemetry * 1e6:.1f} µs = {telemetry * 1e3 / decode_step_ms:.3%}"
        f" of a {decode_step_ms:.0f} ms decode step (the shortest steps of the run).",
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
