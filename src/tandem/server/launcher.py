"""`tandem serve`: start the engine core, then uvicorn; drain on SIGTERM; exit non-zero if the
engine core dies. The two processes: this one (HTTP, tokenizer, detokenizer, metrics) and the
engine core's (the step loop), started by AsyncLLM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from types import FrameType

import uvicorn

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.config import EngineConfig
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.stats import FinishedRequestStats, SchedulerStats, StepStats
from tandem.server.app import ServerSettings, build_app
from tandem.server.metrics import PrometheusStatLogger

logger = logging.getLogger("tandem.server")


class RequestLogger:
    """One log line per finished sequence: what it cost and how it ended."""

    def record_steps(self, scheduler_stats: SchedulerStats, steps: list[StepStats]) -> None:
        pass

    def record_finished(self, finished: FinishedRequestStats) -> None:
        metrics = finished.metrics

        def ms(seconds: float | None) -> str:
            return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"

        logger.info(
            "request %s: %d prompt tokens (%d cached), %d generated, TTFT %s, E2E %s, "
            "finish_reason=%s",
            finished.request_id,
            finished.num_prompt_tokens,
            metrics.num_cached_tokens,
            finished.num_generation_tokens,
            ms(metrics.ttft),
            ms(metrics.e2e_latency),
            finished.finish_reason,
        )


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown (stop accepting, let connections finish within the timeout),
    plus: refuse new requests on open connections while draining."""

    def __init__(self, config: uvicorn.Config, settings: ServerSettings) -> None:
        super().__init__(config)
        self.settings = settings

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.settings.draining:
            logger.info("signal %d: draining in-flight requests, admitting none", sig)
        self.settings.draining = True
        super().handle_exit(sig, frame)


async def serve(
    config: EngineConfig,
    *,
    host: str,
    port: int,
    served_model_names: list[str],
    api_key: str | None,
    max_waiting: int | None,
    max_request_bytes: int,
    shutdown_timeout: float,
    trust_request_chat_template: bool = False,
    response_role: str = "assistant",
    return_tokens_as_token_ids: bool = False,
    tool_call_parser: str | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
    reasoning_parser: str | None = None,
    log_requests: bool = True,
    client: EngineCoreClient | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or the engine core's death (1); `client`: an
    engine core already started."""
    start = time.perf_counter() if client is None else client.started_at
    stat_loggers = [PrometheusStatLogger(served_model_names[0])]
    if log_requests:
        stat_loggers.append(RequestLogger())
    engine = await AsyncLLM.create(config, stat_loggers, client=client)
    settings = ServerSettings(
        served_model_names=served_model_names,
        model_root=str(config.model_path),
        api_key=api_key,
        max_waiting=max_waiting,
        max_request_bytes=max_request_bytes,
        trust_request_chat_template=trust_request_chat_template,
        response_role=response_role,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        tool_call_parser=tool_call_parser,
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
        reasoning_parser=reasoning_parser,
    )
    app = build_app(engine, settings)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=int(max(1, shutdown_timeout)),
            lifespan="off",
        ),
        settings,
    )
    exit_code = 0

    def on_engine_death(error: Exception) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    engine.on_death(on_engine_death)
    config_started = server.config
    if not config_started.loaded:
        config_started.load()
    server.lifespan = config_started.lifespan_class(config_started)
    await server.startup()
    if server.should_exit:  # the port could not be bound
        await engine.shutdown()
        return 1
    # The tokenizer, the app and the imports are the bulk of this process's objects and live
    # until it exits: out of the collector's sight, a full collection no longer walks them
    # while tokens wait to be written.
    gc.collect()
    gc.freeze()
    logger.info(
        "ready in %.1f s (model loaded in %.1f s): http://%s:%d, model %s, "
        "%d KV blocks, max_model_len %d",
        time.perf_counter() - start,
        engine.ready.load_seconds,
        host,
        port,
        ", ".join(served_model_names),
        engine.ready.num_kv_blocks,
        engine.max_model_len,
    )
    # uvicorn re-raises a captured SIGTERM once it has shut down, under the handler it found;
    # by then we have drained, so that handler must not turn a clean exit into death by signal.
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        with server.capture_signals():
            await server.main_loop()
            await server.shutdown()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        await engine.shutdown()
    logger.info("stopped (exit code %d)", exit_code)
    return exit_code


def run_server(config: EngineConfig, **kwargs) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    sys.exit(asyncio.run(serve(config, **kwargs)))
