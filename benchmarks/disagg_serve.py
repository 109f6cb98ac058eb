"""Prefill/decode disaggregation against co-located serving on this machine (issue 14).

Co-located: one `tandem serve` on both cores (decode-first, the default budget 2048, and the
budget 512 that BENCHMARKS.md found best for the streams). Disaggregated: one `--role
prefill` instance pinned to core 0 and one `--role decode` instance pinned to core 1 (one
thread each), a `tandem router` in front: sending a request's two legs at once, so its KV
streams while the prompt is computed, or (`--no-kv-streaming`) the decode leg after the
prefill leg's answer, the KV pulled whole. Each configuration runs alone (never two
computing at once), the `stutter` and `chat` workloads through the `tandem bench serve`
client, and the decode side's step log and /metrics say what it computed and what the KV
transfers cost.

    .venv/bin/python benchmarks/disagg_serve.py [--quick] [--out DIR]
    .venv/bin/python benchmarks/disagg_serve.py --handoff [--rounds N]

Writes runs (JSON), a Markdown table and ITL timelines into benchmarks/results/disagg/.
`--handoff` measures what streaming the KV is for instead: long prompts one at a time through
the router, each leg's prefill chunked by a 512-token budget, streamed and sequential setups
alternated `--rounds` times; per request the client's TTFT and the handoff, TTFT minus the
router's prefill leg (what the transfer and the second leg add to the prompt's compute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench import plots
from tandem.bench import workloads as w
from tandem.bench.client import ClientConfig
from tandem.bench.launch import LaunchedServer, free_port, tandem_serve_command
from tandem.bench.report import compute_metrics, latencies, save_run
from tandem.bench.runner import machine, run_benchmark

ROOT = Path(__file__).resolve().parents[1]
KV_CACHE = "2GiB"
SLOS = {"ttft": 1000.0, "tpot": 100.0}  # goodput: TTFT <= 1 s and TPOT <= 100 ms
MAX_GAP_MS = 150.0  # a stream that never pauses longer than this reads smoothly
WORKLOADS = {
    "stutter": (
        lambda: w.stutter_workload(
            3, 1, streams=4, output_len=(192, 192), long_len=1536, long_start=2.0, long_every=3.0
        ),
        None,
    ),
    "chat": (lambda: w.chat_workload(24, 0, scale=0.2, max_input_len=512, max_output_len=128), 2.0),
}
QUICK = {
    "stutter": (
        lambda: w.stutter_workload(
            1, 1, streams=2, output_len=(16, 16), long_len=256, long_start=0.3, long_every=1.0
        ),
        None,
    ),
    "chat": (lambda: w.chat_workload(3, 0, scale=0.05, max_input_len=64, max_output_len=8), 4.0),
}


def pinned(core: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(core), *command]


def metrics_of(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tandem:kv_transfer") and not sample.name.endswith(
                "_created"
            ):
                values[sample.name] = sample.value
    return values


def step_summary(step_log: Path, since: int) -> tuple[dict, int]:
    """Steps logged after line `since`: tokens by kind and step times by phase."""
    lines = step_log.read_text().splitlines() if step_log.exists() else []
    steps = [json.loads(line) for line in lines[since:]]
    by_phase: dict[str, list[float]] = {}
    for step in steps:
        by_phase.setdefault(step["phase"], []).append(step["step_time"] * 1e3)
    summary = {
        "prefill_tokens": sum(s["num_prefill_tokens"] for s in steps),
        "decode_tokens": sum(s["num_decode_tokens"] for s in steps),
        "steps": {k: (len(v), statistics.median(v), max(v)) for k, v in by_phase.items()},
    }
    return summary, len(lines)


class Setup:
    """A configuration: its processes, the URL clients use, where its decode steps are logged."""

    def __init__(self, name: str, out: Path) -> None:
        self.name = name
        self.out = out
        self.servers: list[LaunchedServer] = []
        self.decode_log = out / f"{name.replace(' ', '_')}_steps.jsonl"
        self.decode_url = ""
        self.url = ""

    def start(self, budget: int | None, disaggregated: bool, streaming: bool = True) -> Setup:
        base = ["--kv-cache-memory", KV_CACHE, "--max-model-len", "4096"]
        if budget is not None:
            base += ["--max-num-batched-tokens", str(budget)]
        if not disaggregated:
            command = tandem_serve_command([*base, "--step-log", str(self.decode_log)])
            self.url = self._launch(command, "colocated").url
            self.decode_url = self.url
            return self
        one_thread = {"OMP_NUM_THREADS": "1"}
        kv_port = free_port()
        prefill_args = [*base, "--role", "prefill", "--kv-port", str(kv_port)]
        prefill = self._launch(pinned(0, tandem_serve_command(prefill_args)), "prefill", one_thread)
        decode = self._launch(
            pinned(1, tandem_serve_command(
                [*base, "--role", "decode", "--step-log", str(self.decode_log)]
            )),
            "decode", one_thread,
        )  # fmt: skip
        router = [sys.executable, "-m", "tandem.cli", "router", "--port", "{port}",
                  "--prefill", prefill.url, "--decode", decode.url,
                  "--kv-streaming" if streaming else "--no-kv-streaming"]  # fmt: skip
        self.url = self._launch(router, "router").url
        self.decode_url = decode.url
        return self

    def _launch(self, command: list[str], role: str, env: dict | None = None) -> LaunchedServer:
        log = self.out / f"{self.name.replace(' ', '_')}_{role}.log"
        server = LaunchedServer(command, log, ready_timeout=600, env=env).start()
        print(f"  {role} ready in {server.ready_seconds:.0f} s", flush=True)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def bench(setup: Setup, workload_name: str, sizes: dict, out: Path) -> dict:
    make, rate = sizes[workload_name]
    label = f"{setup.name} {workload_name}"
    _, since = step_summary(setup.decode_log, 0)
    before = metrics_of(setup.decode_url)
    run = run_benchmark(
        make(), ClientConfig(setup.url, "", endpoint="completions"),
        request_rate=rate or float("inf"), label=label, progress=False, slos=SLOS,
    )  # fmt: skip
    time.sleep(1.5)  # the instance's /metrics catch up with its last step
    after = metrics_of(setup.decode_url)
    steps, _ = step_summary(setup.decode_log, since)
    save_run(run, out / f"{label.replace(' ', '_')}.json")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    run["extra"] = {"steps": steps, "kv": delta}
    return run


HANDOFF_PROMPT_TOKENS = 1536
HANDOFF_REQUESTS = 4


def prefill_leg_seconds(router_url: str) -> float:
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_router:prefill_leg_seconds":
            return sum(s.value for s in family.samples if s.name.endswith("_sum"))
    return 0.0


def handoff(setup: Setup, seed: int) -> list[tuple[float, float]]:
    """(TTFT, handoff) in ms for long prompts sent one at a time, streamed to the client."""
    rng = random.Random(seed)
    results = []
    for _ in range(HANDOFF_REQUESTS):
        body = {
            "model": "default", "prompt": w.token_ids_of(rng, HANDOFF_PROMPT_TOKENS, (100, 40000)),
            "max_tokens": 4, "temperature": 0, "stream": True,
        }  # fmt: skip
        leg_before = prefill_leg_seconds(setup.url)
        start = time.perf_counter()
        ttft = None
        url = f"{setup.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=300) as response:
            for line in response.iter_lines():
                if ttft is None and line.startswith("data:"):
                    ttft = time.perf_counter() - start
        time.sleep(0.3)  # the prefill leg's answer reaches the router after the first token
        leg = prefill_leg_seconds(setup.url) - leg_before
        results.append((ttft * 1e3, (ttft - leg) * 1e3))
    return results


def run_handoff(out: Path, rounds: int) -> None:
    by_setup: dict[str, list[tuple[float, float]]] = {}
    for round_index in range(rounds):
        for name, streaming in (("streamed", True), ("sequential", False)):
            setup = Setup(f"handoff {name} {round_index}", out).start(512, True, streaming)
            try:
                measured = handoff(setup, 1000 * round_index + streaming)
            finally:
                setup.stop()
            by_setup.setdefault(name, []).extend(measured)
            print(f"  {name}: " + ", ".join(f"{t:.0f}/{h:.0f}" for t, h in measured), flush=True)
            time.sleep(2)
    lines = [
        f"# Handoff, {datetime.date.today()}, commit {git_commit()}: {HANDOFF_REQUESTS} × "
        f"{rounds} prompts of {HANDOFF_PROMPT_TOKENS} tokens one at a time, budget 512",
        "",
        "| legs | TTFT p50 (ms) | TTFT min–max | handoff p50 (ms) | handoff min–max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, measured in by_setup.items():
        ttfts, handoffs = [t for t, _ in measured], [h for _, h in measured]
        lines.append(
            f"| {name} | {statistics.median(ttfts):.0f} | {min(ttfts):.0f}–{max(ttfts):.0f} | "
            f"{statistics.median(handoffs):.0f} | {min(handoffs):.0f}–{max(handoffs):.0f} |"
        )
    table = "\n".join(lines)
    (out / "handoff.md").write_text(table + "\n")
    print(table)


def git_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()


def row(run: dict) -> str:
    records = run["records"]
    m = compute_metrics(records, SLOS)
    streams = [r for r in records if r.tag == "stream"] or records
    s = compute_metrics(streams)
    smooth = sum(max(latencies(r).itls, default=0.0) * 1e3 <= MAX_GAP_MS for r in streams if r.ok)
    long = compute_metrics([r for r in records if r.tag == "long"])["ttft_ms"]["median"]
    kv = run["extra"]["kv"]
    loaded = kv.get("tandem:kv_transfer_loaded_requests_total", 0)
    per_request = ""
    if loaded:
        mb = kv["tandem:kv_transfer_loaded_bytes_total"] / loaded / 1e6
        ms = kv["tandem:kv_transfer_load_seconds_total"] / loaded * 1e3
        per_request = f"{mb:.2f} MB, {ms:.0f} ms"
    steps = run["extra"]["steps"]
    phases = ", ".join(
        f"{phase} {count} × {median:.0f} ms (max {top:.0f})"
        for phase, (count, median, top) in sorted(steps["steps"].items())
    )
    failed = kv.get("tandem:kv_transfer_failed_requests_total", 0)
    return (
        f"| {run['label']} | {m['output_throughput']:.1f} | {m['ttft_ms']['median']:.0f} | "
        f"{m['ttft_ms']['p99']:.0f} | {s['itl_ms']['median']:.0f} | {s['itl_ms']['p99']:.0f} | "
        f"{s['itl_ms']['max']:.0f} | {smooth} / {len(streams)} | "
        f"{'-' if math.isnan(long) else f'{long:.0f}'} | {m['goodput']:.2f} | {per_request or '-'} "
        f"{'(' + str(int(failed)) + ' failed)' if failed else ''}| "
        f"{steps['prefill_tokens']} / {steps['decode_tokens']} | {phases} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "disagg"))
    parser.add_argument(
        "--handoff",
        action="store_true",
        help="measure the KV handoff of streamed and sequential legs only",
    )
    parser.add_argument("--rounds", type=int, default=2, help="--handoff: alternations")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.handoff:
        run_handoff(out, args.rounds)
        return
    sizes = QUICK if args.quick else WORKLOADS
    setups = [
        ("colocated 2048", 2048, False, False),
        ("colocated 512", 512, False, False),
        ("disaggregated, streamed", None, True, True),
        ("disaggregated, sequential", None, True, False),
    ]
    runs: dict[str, list[dict]] = {name: [] for name in sizes}
    for name, budget, disaggregated, streaming in setups:
        print(f"{name}:", flush=True)
        setup = Setup(name, out).start(budget, disaggregated, streaming)
        try:
            for workload_name in sizes:
                run = bench(setup, workload_name, sizes, out)
                runs[workload_name].append(run)
                print("  " + row(run), flush=True)
        finally:
            setup.stop()
        time.sleep(2)
    commit = git_commit()
    info = machine()
    lines = [
        f"# Disaggregation, {datetime.date.today()}, commit {commit}: {info.get('cpu')}, "
        f"{info['cores']} cores ({', '.join(info.get('flags', []))})",
        "",
        f"SLOs for goodput: TTFT <= {SLOS['ttft']:.0f} ms, TPOT <= {SLOS['tpot']:.0f} ms.",
        "ITL and gap columns: the stutter workload's streams only (all requests for chat).",
        "",
        "| run | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | ITL max | "
        f"gaps all ≤ {MAX_GAP_MS:.0f} ms | long prompts' TTFT p50 | goodput (req/s) | "
        "KV per request (pull) | decoding instance: prefill / decode tokens | "
        "its steps by phase: count × median (max) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for workload_name, workload_runs in runs.items():
        lines += [row(run) for run in workload_runs]
        plots.latency_cdfs(workload_runs, out / f"{workload_name}_cdf.png", workload_name)
        for run in workload_runs:
            stem = run["label"].replace(" ", "_")
            plots.itl_timeline(run, out / f"{stem}_itl.png", run["label"])
    table = "\n".join(lines)
    (out / "disagg.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
