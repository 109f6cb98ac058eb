"""Serving comparison on this machine (issue 8): tandem, HF transformers behind a minimal
OpenAI server, and vLLM's CPU build, each started alone (never two engines computing at once),
every workload through `tandem bench`; then tandem's seed-claim experiments:

  (a) stutter: decode-first (budgets 2048 and 512) against prefill-first: the streams' max and
      p99 inter-token gap when long prompts land, and the ITL-over-time plots;
  (b) token budget (--max-num-batched-tokens) 256 -> 8192: throughput against p99 ITL;
  (c) prefix caching on vs off on shared-prefix and multi-turn: TTFT.

Writes runs (JSON), Markdown tables and PNGs into benchmarks/results/serve_workloads/. Sizes are
small so the whole run takes about 25 minutes on 2 cores (SIZES below; --quick: a smoke test).

    .venv/bin/python benchmarks/serve_workloads.py [--engines tandem,hf,vllm] [--quick]
        [--skip-compare] [--skip-experiments]

vLLM runs only where benchmarks/peers/setup_vllm_cpu.sh has made .venv-vllm (it is skipped,
and said so, otherwise); its HF folder is exported on first use.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench import plots
from tandem.bench import workloads as w
from tandem.bench.client import ClientConfig
from tandem.bench.launch import LaunchedServer, tandem_serve_command
from tandem.bench.report import compute_metrics, runs_table, save_run
from tandem.bench.runner import machine, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
HF_FOLDER = ROOT / "benchmarks" / "results" / "models" / "smollm2-135m-instruct"
KV_CACHE = "2GiB"

# name: (workload, request rate). Words are tokens on SmolLM2 (one each).
SIZES = {
    "random": (lambda: w.random_workload(16, 0, (64, 256), (32, 32)), 2.0),
    "chat": (lambda: w.chat_workload(16, 0, scale=0.2, max_input_len=512, max_output_len=128), 2.0),
    "stutter": (
        lambda: w.stutter_workload(
            2, 0, streams=4, output_len=(128, 128), long_len=1024, long_start=1.5, long_every=3.0
        ),
        None,
    ),
    "shared-prefix": (
        lambda: w.shared_prefix_workload(
            16, 0, prefix_len=512, suffix_len=(32, 32), output_len=(16, 16)
        ),
        4.0,
    ),
    "multi-turn": (
        lambda: w.multi_turn_workload(
            4, 0, turns=3, system_len=64, input_len=(32, 32), output_len=(24, 24)
        ),
        float("inf"),
    ),
}
QUICK = {
    "random": (lambda: w.random_workload(3, 0, (16, 32), (4, 4)), 4.0),
    "chat": (lambda: w.chat_workload(3, 0, scale=0.05, max_input_len=64, max_output_len=8), 4.0),
    "stutter": (
        lambda: w.stutter_workload(
            1, 0, streams=2, output_len=(16, 16), long_len=128, long_start=0.3, long_every=1.0
        ),
        None,
    ),
    "shared-prefix": (
        lambda: w.shared_prefix_workload(3, 0, prefix_len=64, suffix_len=(8, 8), output_len=(4, 4)),
        4.0,
    ),
    "multi-turn": (
        lambda: w.multi_turn_workload(
            2, 0, turns=2, system_len=8, input_len=(8, 8), output_len=(4, 4)
        ),
        float("inf"),
    ),
}


def policy_flag() -> str:
    """`tandem serve`'s flag for decode-first / prefill-first (renamed from
    --scheduling-policy to --batching-policy)."""
    text = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "--batching-policy" if "--batching-policy" in text else "--scheduling-policy"


def engines(names: list[str], out: Path, dtype: str) -> dict[str, list[str]]:
    """Launch commands; tandem and vLLM at `dtype`, HF in float32 (as people run it on CPU)."""
    commands = {}
    for name in names:
        if name == "tandem":
            commands[name] = tandem_serve_command(["--kv-cache-memory", KV_CACHE, "--dtype", dtype])
        elif name == "hf":
            commands[name] = [sys.executable, str(PEERS / "hf_server.py"), "--port", "{port}"]
        elif name == "vllm":
            if not (ROOT / ".venv-vllm" / "bin" / "python").exists():
                print("vllm: skipped, no .venv-vllm (run benchmarks/peers/setup_vllm_cpu.sh)")
                continue
            if not (HF_FOLDER / "config.json").exists():
                subprocess.run(
                    [sys.executable, str(PEERS / "export_hf_folder.py"), "--out", str(HF_FOLDER)],
                    check=True,
                )
            commands[name] = [
                "bash", str(PEERS / "serve_vllm.sh"), "{port}", str(HF_FOLDER), "--dtype", dtype
            ]  # fmt: skip
        else:
            raise SystemExit(f"unknown engine {name!r}: tandem, hf or vllm")
    return commands


def serve(command: list[str], log: Path) -> LaunchedServer:
    server = LaunchedServer(command, log, ready_timeout=600).start()
    print(
        f"  ready in {server.ready_seconds:.0f} s: {' '.join(server.command[:6])} ...", flush=True
    )
    return server


def bench(
    server: LaunchedServer, workload: w.Workload, rate: float | None, label: str, out: Path
) -> dict:
    config = ClientConfig(server.url, "", endpoint="completions")
    run = run_benchmark(
        workload, config, request_rate=rate or float("inf"), label=label, progress=False
    )
    save_run(run, out / f"{label.replace(' ', '_').replace(',', '')}.json")
    m = run["metrics"]
    print(
        f"  {label}: {m['completed']} ok, {m['failed']} failed, "
        f"{m['output_throughput']:.1f} out tok/s, TTFT p50 {m['ttft_ms']['median']:.0f} ms, "
        f"ITL p99 {m['itl_ms']['p99']:.0f} ms",
        flush=True,
    )
    return run


def compare(names: list[str], sizes: dict, out: Path, dtype: str) -> list[str]:
    by_workload: dict[str, list[dict]] = {name: [] for name in sizes}
    ready: list[str] = []
    for engine, command in engines(names, out, dtype).items():
        print(f"{engine}:", flush=True)
        server = serve(command, out / f"{engine}.log")
        ready.append(f"{engine} {server.ready_seconds:.0f} s")
        try:
            for name, (make, rate) in sizes.items():
                by_workload[name].append(bench(server, make(), rate, f"{engine} {name}", out))
        finally:
            server.stop()
        time.sleep(2)
    lines = [
        "## Engines compared, one workload at a time",
        "",
        f"Start-up until /health answered: {', '.join(ready)}.",
        "",
    ]
    for name, runs in by_workload.items():
        if not runs:
            continue
        params = runs[0]["workload"]
        rate = sizes[name][1]
        lines += [
            f"### {name}: {describe(params)}, rate {rate or 'self-timed'}",
            "",
            runs_table(runs),
            "",
        ]
        plots.latency_cdfs(runs, out / f"compare_{name}_cdf.png", f"{name}: engines compared")
        if name == "stutter":
            for run in runs:
                plots.itl_timeline(run, out / f"compare_stutter_itl_{run['label'].split()[0]}.png")
    return lines


def describe(params: dict) -> str:
    skip = {"name", "prompt_format", "input_mean", "input_sigma", "output_mean", "output_sigma"}
    return ", ".join(f"{k} {v}" for k, v in params.items() if k not in skip)


# Issue 9's stutter scenario: STUTTER_STREAMS streams decoding, prompts of 1,536 tokens
# arriving from LONG_START seconds, one every LONG_EVERY.
STUTTER_STREAMS = 8
STREAM_TOKENS_ALONE = 160  # a streams-alone run's, which measures their pace
LONG_START, LONG_EVERY = 2.0, 3.0


def stutter_scenario(num_long: int, stream_tokens: int = STREAM_TOKENS_ALONE) -> w.Workload:
    return w.stutter_workload(
        num_long, 1, streams=STUTTER_STREAMS, output_len=(stream_tokens, stream_tokens),
        long_len=1536, long_start=LONG_START, long_every=LONG_EVERY,
    )  # fmt: skip


def covering_stream_tokens(num_long: int, seconds_per_token: float) -> int:
    """Tokens that keep a stream decoding, at `seconds_per_token`, until LONG_EVERY after the
    last long prompt's arrival: every prompt then arrives while the streams decode (streams of
    a fixed length end before the later prompts come once the engine is fast enough)."""
    return math.ceil((LONG_START + num_long * LONG_EVERY) / seconds_per_token)


def stream_figures(run: dict) -> dict:
    """The streams' gaps and the long prompts' TTFTs (each, in arrival order, and their median),
    and how many long prompts got their first token while every stream still decoded (the
    others ran beside fewer streams, or none)."""
    streams = [r for r in run["records"] if r.tag == "stream"]
    longs = sorted((r for r in run["records"] if r.tag == "long" and r.ok), key=lambda r: r.send)
    m = compute_metrics(streams)
    long_ttfts = [(r.chunks[0] - r.send) * 1e3 for r in longs]
    first_stream_end = min((r.end for r in streams), default=0.0)
    return {
        "itl_p50": m["itl_ms"]["median"],
        "itl_p99": m["itl_ms"]["p99"],
        "itl_max": m["itl_ms"]["max"],
        "long_ttft": statistics.median(long_ttfts or [0]),
        "long_ttfts": long_ttfts,
        "long_beside_streams": sum(r.chunks[0] < first_stream_end for r in longs),
        "failed": sum(not r.ok for r in run["records"]),
    }


def experiments(quick: bool, out: Path) -> list[str]:
    flag = policy_flag()
    lines = ["## tandem: seed-claim experiments", ""]

    # (a) stutter per batching policy
    stutter = (
        (
            lambda: w.stutter_workload(
                1, 1, streams=2, output_len=(24, 24), long_len=256, long_start=0.3, long_every=1.0
            )
        )
        if quick
        else (
            lambda: w.stutter_workload(
                3,
                1,
                streams=4,
                output_len=(192, 192),
                long_len=1536,
                long_start=2.0,
                long_every=3.0,
            )
        )
    )
    rows = [
        "| policy | token budget | streams' ITL p50 | p99 | max | long prompt TTFT p50 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy, budget in (("decode-first", 2048), ("decode-first", 512), ("prefill-first", 2048)):
        args = [
            "--kv-cache-memory",
            KV_CACHE,
            flag,
            policy,
            "--max-num-batched-tokens",
            str(budget),
        ]
        label = f"stutter {policy} {budget}"
        server = serve(tandem_serve_command(args), out / f"tandem_{policy}_{budget}.log")
        try:
            run = bench(server, stutter(), None, label, out)
        finally:
            server.stop()
        plots.itl_timeline(
            run,
            out / f"stutter_{policy}_{budget}_itl.png",
            f"Stutter, tandem {policy}, token budget {budget}",
        )
        f = stream_figures(run)
        rows.append(
            f"| {policy} | {budget} | {f['itl_p50']:.0f} ms | {f['itl_p99']:.0f} ms | "
            f"{f['itl_max']:.0f} ms | {f['long_ttft']:.0f} ms |"
        )
    params = stutter().params
    lines += [f"### (a) stutter ({describe(params)})", "", *rows, ""]

    # (b) token budget sweep
    budgets = [256, 2048] if quick else [256, 512, 1024, 2048, 4096, 8192]
    make = (
        (lambda: w.random_workload(3, 2, (32, 64), (4, 4)))
        if quick
        else (lambda: w.random_workload(24, 2, (256, 768), (32, 32)))
    )
    rate = 4.0 if quick else 1.5
    points = []
    for budget in budgets:
        args = ["--kv-cache-memory", KV_CACHE, "--max-num-batched-tokens", str(budget)]
        server = serve(tandem_serve_command(args), out / f"tandem_budget_{budget}.log")
        try:
            points.append((f"{budget}", bench(server, make(), rate, f"budget {budget}", out)))
        finally:
            server.stop()
    plots.sweep_plot(
        {"tandem, decode-first": points},
        out / "budget_sweep.png",
        f"tandem: token budget {budgets[0]} → {budgets[-1]} (labels: max-num-batched-tokens)",
    )
    lines += [
        f"### (b) token budget sweep ({describe(make().params)}, rate {rate}/s)",
        "",
        runs_table([run for _, run in points]),
        "",
    ]

    # (c) prefix caching on vs off
    shared = (
        (lambda: w.shared_prefix_workload(3, 3, prefix_len=64, output_len=(4, 4)))
        if quick
        else (lambda: w.shared_prefix_workload(16, 3, prefix_len=1024, output_len=(16, 16)))
    )
    chat = (
        (lambda: w.multi_turn_workload(2, 3, turns=2, system_len=16, output_len=(4, 4)))
        if quick
        else (
            lambda: w.multi_turn_workload(
                4, 3, turns=4, system_len=200, input_len=(48, 48), output_len=(32, 32)
            )
        )
    )
    runs = []
    for caching in ("on", "off"):
        args = ["--kv-cache-memory", KV_CACHE] + (
            [] if caching == "on" else ["--no-enable-prefix-caching"]
        )
        server = serve(tandem_serve_command(args), out / f"tandem_prefix_{caching}.log")
        try:
            runs.append(bench(server, shared(), 1.0, f"shared-prefix caching {caching}", out))
            runs.append(bench(server, chat(), float("inf"), f"multi-turn caching {caching}", out))
        finally:
            server.stop()
    plots.latency_cdfs(
        [runs[0], runs[2]],
        out / "prefix_shared_cdf.png",
        "Shared 1024-token prefix: prefix caching on vs off",
    )
    plots.latency_cdfs(
        [runs[1], runs[3]],
        out / "prefix_multiturn_cdf.png",
        "Multi-turn chat: prefix caching on vs off",
    )
    turn_rows = [
        "| prefix caching | "
        + " | ".join(f"turn {t + 1}" for t in range(len(chat().sessions[0].turns)))
        + " |"
    ]
    turn_rows.append("|---|" + "---:|" * len(chat().sessions[0].turns))
    for run in (runs[1], runs[3]):
        by_turn = {}
        for r in run["records"]:
            if r.ok:
                by_turn.setdefault(r.turn, []).append((r.chunks[0] - r.send) * 1e3)
        cells = [f"{statistics.median(by_turn[t]):.0f} ms" for t in sorted(by_turn)]
        turn_rows.append(f"| {run['label'].split()[-1]} | " + " | ".join(cells) + " |")
    lines += [
        f"### (c) prefix caching: shared prefix ({describe(shared().params)}, rate 1/s) "
        f"and multi-turn ({describe(chat().params)})",
        "",
        runs_table(runs),
        "",
        "Multi-turn TTFT by turn (median over conversations):",
        "",
        *turn_rows,
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="tandem,hf,vllm")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results/serve_workloads")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--skip-compare", action="store_true")
    parser.add_argument("--skip-experiments", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="for tandem and vLLM (bfloat16 pays with AMX)")  # fmt: skip
    args = parser.parse_args()
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    info = machine()
    lines = [
        f"# Serving benchmarks, {datetime.date.today()}",
        "",
        f"Machine: {info.get('cpu')}, {info['cores']} cores, flags "
        f"{' '.join(info.get('flags', []))}; {platform.platform()}",
        "",
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
        "",
        f"tandem and vLLM run in {args.dtype}, HF transformers in float32.",
        "",
    ]
    if not args.skip_compare:
        sizes = QUICK if args.quick else SIZES
        lines += compare(args.engines.split(","), sizes, out, args.dtype)
    if not args.skip_experiments:
        lines += experiments(args.quick, out)
    lines.append(f"Total time: {(time.monotonic() - start) / 60:.1f} min")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {out}/summary.md, runs (*.json) and plots (*.png)")


if __name__ == "__main__":
    main()
