"""`tandem generate | chat | serve | bench`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator

from tandem.core.request_queue import SCHEDULING_POLICIES
from tandem.core.scheduler_config import BATCHING_POLICIES
from tandem.sampling_params import LOGPROBS_MODES, SamplingParams
from tandem.server.reasoning_parsers import REASONING_PARSERS
from tandem.server.tool_parsers import TOOL_PARSERS

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Byte counts such as 2GiB, 512MiB or 1000000."""
    match = _SIZE.match(text)
    if match is None or (match.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1e9)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine knob of LLM / EngineConfig.create, under vLLM's flag names."""
    parser.add_argument(
        "--model",
        default="default",
        help="HF folder, .gguf file, or 'default' (embedded SmolLM2-135M)",
    )
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder or .gguf file (default: the model's)")  # fmt: skip
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="refused: tandem never runs code from a checkpoint")  # fmt: skip
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="must be 1: one model on one device")  # fmt: skip
    parser.add_argument("--dtype", default="auto",
                        help="auto, float32 (float), bfloat16 or float16 (half); auto: "
                             "on CPU the formats a probe measures fastest here, on CUDA "
                             "the checkpoint's (fp32 as bf16)")  # fmt: skip
    # model_runner.KV_CACHE_DTYPES, written out: the CLI's parser loads without torch.
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="the KV cache's element type; auto: the model's dtype, but "
                             "bfloat16 for a float32 model under --dtype auto on the cpu "
                             "attention backend (float32: exact)")  # fmt: skip
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0,
                        help="global seed: requests without their own draw from it")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of a step (default 2048; without chunked prefill "
                             "max(2048, max-model-len))")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs a request may ask for (-1: no limit)")  # fmt: skip
    parser.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                        help="queue order: fcfs, or priority (lower value first)")  # fmt: skip
    parser.add_argument("--batching-policy", default="decode-first", choices=BATCHING_POLICIES,
                        help="decode-first (mixed, stall-free) or prefill-first")  # fmt: skip
    parser.add_argument("--enable-chunked-prefill", default=True,
                        action=argparse.BooleanOptionalAction)  # fmt: skip
    parser.add_argument("--enable-prefix-caching", default=True,
                        action=argparse.BooleanOptionalAction)  # fmt: skip
    parser.add_argument("--prefix-caching-hash-algo", default="xxhash",
                        choices=["xxhash", "sha256"])  # fmt: skip
    parser.add_argument("--max-num-partial-prefills", type=int, default=1)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="max tokens a prompt takes per step (0: half budget)")  # fmt: skip
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None,
                        help="KV cache size, e.g. 2GiB (default: 2 GiB on CPU; on CUDA, what "
                        "--gpu-memory-utilization leaves after a profiling step)")  # fmt: skip
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto (the model's generation_config.json), "
                             "vllm (none), or a folder")  # fmt: skip
    parser.add_argument("--override-generation-config", type=json.loads, default=None,
                        help='JSON, e.g. \'{"temperature": 0.5}\'')  # fmt: skip
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats log line")  # fmt: skip
    parser.add_argument("--target-itl-ms", type=float, default=None,
                        help="fit each step's prefill to this step time (ms)")  # fmt: skip
    parser.add_argument("--step-log", default=None,
                        help="append a JSON line per engine step (work, MFU, MBU)")  # fmt: skip
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s for MFU (default: data sheet or probe)")  # fmt: skip
    parser.add_argument("--peak-bandwidth-gbps", type=float, default=None,
                        help="peak memory GB/s for MBU (default: data sheet or probe)")  # fmt: skip
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help='speculative decoding, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\'')  # fmt: skip
    parser.add_argument("--attention-backend", default="auto",
                        help="torch (the reference), cpu (a C decode kernel built for this "
                        "CPU) or triton (CUDA); auto: triton on CUDA when installed, cpu on "
                        "CPU when a C compiler builds it, torch elsewhere")  # fmt: skip
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="schedule the next step while the forward runs "
                        "(default: on for CUDA, off on CPU)")  # fmt: skip
    parser.add_argument("--adapt-cpu-threads", action=argparse.BooleanOptionalAction,
                        default=True, help="on CPU, drop forward threads while other "
                        "processes hold some of the cores, take them back once free "
                        "(default: on)")  # fmt: skip
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="most forwards a step of decodes alone runs (vLLM v0's "
                        "multi-step scheduling; default: up to 8 where a CPU's decode steps "
                        "run fused, within 16 ms a step; else 1)")  # fmt: skip
    # vLLM's, accepted and logged where they change nothing (docs/coming-from-vllm.md).
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--swap-space", type=float, default=None)
    parser.add_argument("--enforce-eager", action="store_true", default=None)
    parser.add_argument("--compilation-config", type=json.loads, default=None,
                        help="a level (0 eager, 1-3 torch.compile of the layers, CPU) or "
                        '{"level": n}')  # fmt: skip


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def add_kv_transfer_args(parser: argparse.ArgumentParser) -> None:
    from tandem.kv_transfer.config import DEFAULT_KV_PORT, ROLES

    parser.add_argument("--role", default="both", choices=ROLES,
                        help="disaggregated serving: prefill (computes prompts, keeps their KV "
                        "for decode instances), decode (pulls it), or both (default)")  # fmt: skip
    parser.add_argument("--kv-host", default=os.environ.get("TANDEM_KV_HOST", "127.0.0.1"),
                        help="address peers reach this instance's KV transfers at "
                        "(or TANDEM_KV_HOST)")  # fmt: skip
    parser.add_argument("--kv-port", type=int,
                        default=int(os.environ.get("TANDEM_KV_PORT", DEFAULT_KV_PORT)),
                        help="prefill role: KV control port, and port + 1 "
                        "(or TANDEM_KV_PORT)")  # fmt: skip
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                        help="decode role: seconds before a KV pull (or a silent stream) "
                        "falls back to a local prefill; prefill role: seconds a stream waits "
                        "for its prefill leg")  # fmt: skip
    parser.add_argument("--kv-hold-seconds", type=float, default=120.0,
                        help="prefill role: seconds a finished prompt's KV waits to be "
                        "pulled")  # fmt: skip


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine knobs, as EngineConfig.create (and LLM) take them."""
    return dict(
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        seed=args.seed,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        block_size=args.block_size,
        scheduling_policy=args.scheduling_policy,
        batching_policy=args.batching_policy,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        max_num_partial_prefills=args.max_num_partial_prefills,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        disable_log_stats=args.disable_log_stats,
        gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space,
        enforce_eager=args.enforce_eager,
        compilation_config=args.compilation_config,
        step_log=args.step_log,
        peak_tflops=args.peak_tflops,
        peak_bandwidth_gbps=args.peak_bandwidth_gbps,
        target_itl_ms=args.target_itl_ms,
        speculative_config=args.speculative_config,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend,
        num_scheduler_steps=args.num_scheduler_steps,
        adapt_cpu_threads=args.adapt_cpu_threads,
    )


def build_llm(args: argparse.Namespace):
    from tandem.engine.llm import LLM

    return LLM(args.model, **engine_kwargs(args))


def cmd_serve(args: argparse.Namespace) -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.core_client import EngineCoreClient

    model = args.model_tag or args.model
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    config = EngineConfig.create(
        model,
        **engine_kwargs(args),
        kv_transfer_config=kv_transfer_config(args),
        stream_writes_first=args.stream_writes_first,
    )
    # The engine core starts loading the model before this process imports the server
    # (FastAPI, uvicorn, transformers: 2-3 s that overlap the core's start on another core).
    client = EngineCoreClient(config)
    from tandem.server.launcher import run_server

    run_server(
        config,
        client=client,
        host=args.host,
        port=args.port,
        served_model_names=args.served_model_name or [str(model)],
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        # as vLLM: a parser without --enable-auto-tool-choice reads nothing
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        shutdown_timeout=args.shutdown_timeout,
        log_requests=not args.disable_log_requests,
    )


def kv_transfer_config(args: argparse.Namespace):
    """The serve command's disaggregation settings; None for role both."""
    from tandem.kv_transfer.config import KVTransferConfig

    if args.role == "both":
        return None
    return KVTransferConfig(
        role=args.role,
        host=args.kv_host,
        port=args.kv_port,
        timeout=args.kv_transfer_timeout,
        hold_seconds=args.kv_hold_seconds,
    )


def cmd_router(args: argparse.Namespace) -> None:
    from tandem.router.app import run_router

    run_router(
        prefill_urls=args.prefill,
        decode_urls=args.decode,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        poll_interval=args.poll_interval,
        request_timeout=args.request_timeout,
        discover=args.dns_discovery,
        kv_streaming=args.kv_streaming,
    )


def cmd_plot_steps(args: argparse.Namespace) -> None:
    from tandem.bench.step_plots import plot_steps

    for path in plot_steps(args.step_log, args.out):
        print(path)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # a bad value fails before the model loads
    llm = build_llm(args)
    start = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_generated = 0
    for prompt, output in zip(args.prompt, outputs, strict=True):
        completion = output.outputs[0]
        num_generated += len(completion.token_ids)
        print(f"### {prompt}\n{completion.text}\n")
        metrics = completion.metrics
        print(
            f"[{len(output.prompt_token_ids)} prompt tokens, {len(completion.token_ids)} "
            f"generated, finish_reason={completion.finish_reason}, "
            f"TTFT {metrics.ttft * 1e3:.0f} ms, TPOT {(metrics.tpot or 0) * 1e3:.1f} ms]\n"
        )
    print(f"{num_generated} tokens in {elapsed:.2f} s ({num_generated / elapsed:.1f} tok/s)")


def stream_answer(llm, conversation: list[dict[str, str]], params: SamplingParams) -> Iterator:
    """Yield the answer's text deltas, then the final RequestOutput."""
    from tandem.engine.llm_engine import OutputKind

    text = llm.tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    token_ids = list(llm.tokenizer(text, add_special_tokens=False).input_ids)
    request_id = f"chat-{time.monotonic_ns()}"
    llm.llm_engine.add_request(request_id, token_ids, params, prompt=text,
                           output_kind=OutputKind.DELTA)  # fmt: skip
    try:
        while llm.llm_engine.has_unfinished_requests():
            for output in llm.llm_engine.step():
                if output.request_id != request_id:
                    continue
                yield output.outputs[0].text
                if output.finished:
                    yield output
                    return
    finally:
        llm.llm_engine.abort_request(request_id)


def cmd_chat(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # a bad value fails before the model loads
    llm = build_llm(args)
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print("tandem chat: type a message; /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            del conversation[int(bool(args.system)) :]
            continue
        if not line:
            continue
        conversation.append({"role": "user", "content": line})
        answer = []
        final = None
        for item in stream_answer(llm, conversation, params):
            if isinstance(item, str):
                answer.append(item)
                print(item, end="", flush=True)
            else:
                final = item
        conversation.append({"role": "assistant", "content": "".join(answer)})
        metrics = final.outputs[0].metrics
        num_tokens = len(metrics.token_times)
        rate = (num_tokens - 1) / metrics.decode_time if metrics.decode_time else 0.0
        print(f"\n[TTFT {metrics.ttft * 1e3:.0f} ms, {num_tokens} tokens, {rate:.1f} tok/s]")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem", description="LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate completions for prompts")
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.add_argument("--prompt", action="append", required=True,
                          help="a prompt (repeat for a batch)")  # fmt: skip
    generate.add_argument("--chat", action="store_true",
                          help="wrap each prompt in the model's chat template")  # fmt: skip
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat in the terminal, streamed")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None,
                       help="model to serve (as --model; default: embedded SmolLM2)")  # fmt: skip
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Bearer KEY' on /v1 (or TANDEM_API_KEY)")  # fmt: skip
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients send as 'model' (default: the model)")  # fmt: skip
    serve.add_argument("--max-waiting", type=int, default=None,
                       help="answer 503 + Retry-After while this many requests wait")  # fmt: skip
    serve.add_argument("--max-request-bytes", type=parse_size, default="32MiB",
                       help="largest request body (413 above it)")  # fmt: skip
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="run chat templates sent by requests (code in the server)")  # fmt: skip
    serve.add_argument("--response-role", default="assistant",
                       help="role of chat replies that start a new message")  # fmt: skip
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help='logprobs name tokens "token_id:{id}" by default')  # fmt: skip
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": read calls out of replies (needs '
                       "--tool-call-parser)")  # fmt: skip
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how the model writes tool calls")  # fmt: skip
    serve.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split reasoning models' thinking from their answers")  # fmt: skip
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='no tools in the chat template for tool_choice "none"')  # fmt: skip
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM")  # fmt: skip
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="no log line per finished request")  # fmt: skip
    serve.add_argument("--stream-writes-first", action=argparse.BooleanOptionalAction,
                       default=None, help="after a step's outputs for 8 or more streams, the "
                       "engine core waits up to 5 ms for this process to write their chunks "
                       "before its next forward (default: on for CPU, where the forward takes "
                       "every core)")  # fmt: skip
    add_kv_transfer_args(serve)
    serve.set_defaults(func=cmd_serve)

    router = commands.add_parser(
        "router", help="OpenAI-compatible front of disaggregated prefill and decode instances"
    )
    router.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="base URLs of instances started with --role prefill")  # fmt: skip
    router.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="base URLs of instances started with --role decode")  # fmt: skip
    router.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--api-key", default=None,
                        help="require 'Bearer KEY' on /v1 and send it on "
                        "(or TANDEM_API_KEY)")  # fmt: skip
    router.add_argument("--poll-interval", type=float, default=1.0,
                        help="seconds between health and load polls of each instance")  # fmt: skip
    router.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds an instance may take to answer a request")  # fmt: skip
    router.add_argument("--dns-discovery", action="store_true",
                        help="each URL's host name stands for every address it resolves to, "
                        "looked up at each poll (a Kubernetes headless Service)")  # fmt: skip
    router.add_argument("--kv-streaming", action=argparse.BooleanOptionalAction, default=True,
                        help="send a request's prefill and decode legs at once, so its KV "
                        "streams to the decode instance while the prompt is computed; "
                        "--no-kv-streaming: the decode leg after the prefill leg's answer, "
                        "the KV pulled whole")  # fmt: skip
    router.set_defaults(func=cmd_router)

    from tandem.bench.cli import add_bench_parser

    add_bench_parser(commands)

    plot = commands.add_parser("plot", help="figures of an engine's step log")
    plot_sub = plot.add_subparsers(dest="plot_command", required=True)
    steps = plot_sub.add_parser("steps", help="roofline and step timeline of a --step-log file")
    steps.add_argument("step_log", help="the JSONL file written with --step-log")
    steps.add_argument("--out", default="step-plots", help="folder for the PNG figures")
    steps.set_defaults(func=cmd_plot_steps)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
