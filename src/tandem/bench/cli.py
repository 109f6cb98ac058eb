"""`tandem bench serve | sweep | compare | plot`."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

from tandem.bench.report import (
    compare_table,
    format_summary,
    load_run,
    parse_goodput,
    runs_table,
    save_run,
)
from tandem.bench.workloads import add_workload_args, build_workload


def rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a request rate must be positive or inf: {text!r}")
    return value


def number_list(kind):
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"not a comma-separated list: {text!r}") from None

    return parse


def add_client_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server and load")
    group.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)"
    )
    group.add_argument("--model", default=None, help="model name (default: the server's first)")
    group.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="completions",
        help="/v1/completions or /v1/chat/completions",
    )
    group.add_argument("--api-key", default=None)
    group.add_argument(
        "--request-rate",
        type=rate,
        default=math.inf,
        help="requests (sessions) per second, or inf: all at once",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps between arrivals (1: Poisson)",
    )
    group.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    group.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (outputs may end early)",
    )
    group.add_argument("--no-warmup", dest="warmup", action="store_false")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_workload_args(parser)


def client_config(args: argparse.Namespace, base_url: str | None = None):
    from tandem.bench.client import ClientConfig

    return ClientConfig(
        base_url=(base_url or args.base_url).rstrip("/"),
        model=args.model or "",
        endpoint=args.endpoint,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
    )


def bench_once(
    args: argparse.Namespace,
    base_url: str | None = None,
    label: str | None = None,
    request_rate: float | None = None,
    extra: dict | None = None,
) -> dict:
    from tandem.bench.runner import run_benchmark

    slos = parse_goodput(args.goodput)
    return run_benchmark(
        build_workload(args),
        client_config(args, base_url),
        request_rate=args.request_rate if request_rate is None else request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        slos=slos,
        label=label,
        warmup=args.warmup,
        progress=not args.disable_tqdm,
        extra=extra,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    run = bench_once(args, label=args.label)
    print(format_summary(run["metrics"], f"{run['label']}"))
    if args.out:
        save_run(run, args.out)
        print(f"records and figures: {args.out}")
    if args.plots:
        from tandem.bench import plots

        stem = Path(args.out).stem if args.out else run["workload"]["name"]
        for path in (
            plots.latency_cdfs([run], Path(args.plots) / f"{stem}_cdf.png"),
            plots.itl_timeline(run, Path(args.plots) / f"{stem}_itl.png"),
        ):
            print(f"plot: {path}")


def cmd_sweep(args: argparse.Namespace) -> None:
    from tandem.bench import plots
    from tandem.bench.launch import LaunchedServer, tandem_serve_command

    out = Path(args.out_dir)
    budgets = args.max_num_batched_tokens or [None]
    rates = args.request_rates or [args.request_rate]
    series: dict[str, list[tuple[str, dict]]] = {}
    runs = []
    for budget in budgets:
        name = "tandem" if budget is None or len(rates) == 1 else f"budget {budget}"
        server = None
        if budget is not None:
            command = tandem_serve_command(
                ["--max-num-batched-tokens", str(budget), *shlex.split(args.serve_args)]
            )
            server = LaunchedServer(command, out / f"server_budget{budget}.log").start()
        try:
            for request_rate in rates:
                tag = f"rate {request_rate:g}/s" if len(rates) > 1 else f"budget {budget}"
                label = f"{name}, {tag}" if len(rates) > 1 and budget else tag
                run = bench_once(
                    args,
                    server.url if server else None,
                    label,
                    request_rate,
                    {"max_num_batched_tokens": budget},
                )
                file = out / f"sweep_{'b' + str(budget) if budget else 'x'}_r{request_rate:g}.json"
                save_run(run, file)
                print(format_summary(run["metrics"], label))
                series.setdefault(name, []).append((tag, run))
                runs.append(run)
        finally:
            if server is not None:
                server.stop()
    table = compare_table(runs)
    (out / "sweep.md").write_text(table + "\n")
    print(table)
    print(f"plot: {plots.sweep_plot(series, out / 'sweep.png')}")
    print(f"plot: {plots.latency_cdfs(runs, out / 'sweep_cdf.png')}")


def cmd_compare(args: argparse.Namespace) -> None:
    runs = [load_run(path) for path in args.runs]
    slos = parse_goodput(args.goodput) or None
    table = runs_table(runs, slos) if args.by_run else compare_table(runs, slos)
    if args.out:
        Path(args.out).write_text(table + "\n")
    print(table)


def cmd_plot(args: argparse.Namespace) -> None:
    from tandem.bench import plots

    runs = [load_run(path) for path in args.runs]
    out = Path(args.out_dir)
    print(f"plot: {plots.latency_cdfs(runs, out / 'cdf.png', args.title)}")
    for path, run in zip(args.runs, runs, strict=True):
        print(f"plot: {plots.itl_timeline(run, out / f'{Path(path).stem}_itl.png')}")


def guarded(command):
    """A command whose BenchError (server unreachable, warm-up failed) is one line, exit 1."""

    def run(args: argparse.Namespace) -> None:
        from tandem.bench.client import BenchError

        try:
            command(args)
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)

    return run


def add_bench_parser(commands) -> None:
    """The `bench` command and its subcommands, under `tandem`."""
    bench = commands.add_parser("bench", help="benchmark an OpenAI-compatible server")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="streaming load against a running server")
    add_client_args(serve)
    serve.add_argument("--label", default=None, help="the run's name in tables and plots")
    serve.add_argument("--out", default=None, help="JSON file: every request's timestamps")
    serve.add_argument("--plots", default=None, help="folder for the PNG figures")
    serve.set_defaults(func=guarded(cmd_serve))

    sweep = sub.add_parser("sweep", help="serve runs over request rates or token budgets")
    add_client_args(sweep)
    sweep.add_argument(
        "--request-rates",
        type=number_list(rate),
        default=None,
        help="comma-separated, e.g. 0.5,1,2,inf",
    )
    sweep.add_argument(
        "--max-num-batched-tokens",
        type=number_list(int),
        default=None,
        help="comma-separated token budgets: starts `tandem serve` for each",
    )
    sweep.add_argument("--serve-args", default="", help="more `tandem serve` arguments, one string")
    sweep.add_argument("--out-dir", default="bench-sweep")
    sweep.set_defaults(func=guarded(cmd_sweep))

    compare = sub.add_parser("compare", help="a Markdown table of runs side by side")
    compare.add_argument("runs", nargs="+", help="JSON files of `bench serve --out`")
    compare.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS")
    compare.add_argument(
        "--by-run",
        action="store_true",
        help="one row per run, the main figures (default: a column per run)",
    )
    compare.add_argument("--out", default=None)
    compare.set_defaults(func=guarded(cmd_compare))

    plot = sub.add_parser("plot", help="CDFs and ITL timelines of saved runs")
    plot.add_argument("runs", nargs="+")
    plot.add_argument("--out-dir", default="bench-plots")
    plot.add_argument("--title", default=None)
    plot.set_defaults(func=guarded(cmd_plot))
