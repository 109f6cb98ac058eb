"""The router's HTTP face. A completion or chat request goes to a prefill instance with
max_tokens 1 and kv_transfer_params {"do_remote_decode": true, "transfer_id": T}, and at the
same time to a decode instance with {"do_remote_prefill": true, "remote_host", "remote_port",
"transfer_id": T}, whose response (streamed or not) is the client's. The prefill instance
computes the prompt and the first token; the decode instance pulls the prompt's KV as each
step computes it, and the first token last, then decodes the rest; it never computes the
prompt unless the transfer fails. Without a known KV endpoint for the prefill instance (its
/metrics), or with `--no-kv-streaming`, the legs go one after the other: the prefill leg's
answer (where the finished prompt's KV waits) becomes the decode leg's kv_transfer_params.

Requests that cannot be split this way go whole to one instance: prompt scoring (prompt
logprobs, echo with logprobs, max_tokens <= 1) to a prefill instance; n > 1, several prompts,
beam search, or kv_transfer_params set by the client, to a decode instance."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import msgspec
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.background import BackgroundTask

import tandem
from tandem.kv_transfer.messages import Release
from tandem.router.instances import Instance, InstancePool
from tandem.server.protocol_responses import error_body

logger = logging.getLogger("tandem.router")

_ZMQ_CONTEXT = zmq.Context()
T = TypeVar("T")

# Fields that change what the prefill leg would compute, or a stream, in the prefill request.
_PREFILL_DROPPED = ("max_completion_tokens", "stream_options", "n", "best_of")


@dataclass
class RouterSettings:
    api_key: str | None = None
    request_timeout: float = 600.0
    kv_streaming: bool = True  # both legs at once (the KV streams), where the endpoint is known


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, None, status), status_code=status)


def _route(kind: str, body: dict[str, Any]) -> str:
    """ "split" (prefill, then decode), or the one role that serves the request whole."""
    if body.get("kv_transfer_params") is not None:
        return "decode"  # the client runs the disaggregation itself
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    wants_prompt_logprobs = body.get("prompt_logprobs") is not None or (
        kind == "completions" and body.get("echo") and body.get("logprobs") is not None
    )
    if wants_prompt_logprobs or (isinstance(max_tokens, int) and max_tokens <= 1):
        return "prefill"
    if body.get("n") not in (None, 1) or body.get("use_beam_search"):
        return "decode"
    if kind == "completions":
        prompt = body.get("prompt")
        one_prompt = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        )
        if not one_prompt:
            return "decode"
    return "split"


def prefill_body(body: dict[str, Any], transfer_id: str | None = None) -> dict[str, Any]:
    """The prefill leg: the prompt and the first token, sampled as the client asked, the KV
    kept for the decode leg (or streamed to it, with a transfer id)."""
    prefill = copy.deepcopy(body)
    for name in _PREFILL_DROPPED:
        prefill.pop(name, None)
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    if isinstance(prefill.get("min_tokens"), int):
        prefill["min_tokens"] = min(prefill["min_tokens"], 1)
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    if transfer_id is not None:
        prefill["kv_transfer_params"]["transfer_id"] = transfer_id
    return prefill


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["instance", "role"]
        self.requests = Counter(
            "tandem_router:requests", "Requests sent to each instance.", labels,
            registry=self.registry,
        )  # fmt: skip
        self.failures = Counter(
            "tandem_router:instance_failures",
            "Requests an instance failed (no answer, or a 5xx).", labels, registry=self.registry,
        )  # fmt: skip
        self.routes = Counter(
            "tandem_router:routes", "Requests by route: split, or whole to prefill or decode.",
            ["route"], registry=self.registry,
        )  # fmt: skip
        self.prefill_fallbacks = Counter(
            "tandem_router:prefill_fallbacks",
            "Split requests no prefill instance could serve: the decode instance prefilled.",
            registry=self.registry,
        )
        self.streamed = Counter(
            "tandem_router:streamed_requests",
            "Split requests whose two legs went out at once (the KV streamed).",
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "tandem_router:prefill_leg_seconds",
            "Seconds of the prefill leg of split requests (prompt and first token).",
            registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.up = Gauge("tandem_router:instance_up", "1 if the instance is healthy.", labels,
                        registry=self.registry)  # fmt: skip
        self.in_flight = Gauge(
            "tandem_router:instance_in_flight", "Requests in flight to the instance.", labels,
            registry=self.registry,
        )  # fmt: skip

    def render(self, pool: InstancePool) -> bytes:
        for instance in pool.instances:
            self.up.labels(instance.url, instance.role).set(1 if instance.healthy else 0)
            self.in_flight.labels(instance.url, instance.role).set(instance.in_flight)
        return generate_latest(self.registry)


def build_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    settings: RouterSettings,
    poll_interval: float = 1.0,
    discover: bool = False,
) -> FastAPI:
    """`discover`: each URL's host name stands for all the addresses it resolves to
    (instances.py)."""
    metrics = _Metrics()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(settings.request_timeout, connect=5.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
            pool = InstancePool(prefill_urls, decode_urls, client, headers, discover)
            await pool.poll()
            state["pool"] = pool
            poller = asyncio.create_task(pool.poll_forever(poll_interval))
            try:
                yield
            finally:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)

    app = FastAPI(title="tandem router", version=tandem.__version__, lifespan=lifespan)

    def pool() -> InstancePool:
        return state["pool"]

    def refusal(request: Request) -> JSONResponse | None:
        if settings.api_key is None or not request.url.path.startswith("/v1"):
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), settings.api_key.encode()
        ):
            return _error(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
            )  # fmt: skip
        return None

    def forward_headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    def note_server_error(instance: Instance, path: str, status: int) -> None:
        """A 5xx: counted; only 503 (the instance is dying, draining or overloaded) takes it
        out of the choice until its next good poll, as one request's 500 says nothing of the
        others'."""
        metrics.failures.labels(instance.url, instance.role).inc()
        if status == 503:
            instance.failed(f"{path} answered 503")
        else:
            instance.num_failures += 1
            instance.last_error = f"{path} answered {status}"

    async def post(
        instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response | None:
        """POST and read the whole answer; None if it gave none or a 5xx (the prefill leg
        then tries another instance)."""
        instance.in_flight += 1
        instance.num_requests += 1
        metrics.requests.labels(instance.url, instance.role).inc()
        try:
            response = await pool().client.post(f"{instance.url}{path}", json=body, headers=headers)
        except httpx.HTTPError as error:
            instance.failed(f"{type(error).__name__}: {error}")
            metrics.failures.labels(instance.url, instance.role).inc()
            return None
        finally:
            instance.in_flight -= 1
        if response.status_code >= 500:
            note_server_error(instance, path, response.status_code)
            return None
        return response

    async def prefill(
        path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | Response | None:
        """The prefill leg on the least loaded prefill instance (the next one if it fails):
        the kv_transfer_params for the decode leg, the instance's answer if it refused the
        request (4xx: the client's to fix), or None if no instance could serve it."""
        start = time.perf_counter()
        tried: tuple[Instance, ...] = ()
        while (instance := pool().choose("prefill", tried)) is not None:
            tried += (instance,)
            response = await post(instance, path, prefill_body(body), headers)
            if response is None:
                continue
            if response.status_code != 200:
                return Response(
                    response.content, response.status_code, media_type="application/json"
                )
            params = response.json().get("kv_transfer_params")
            if not isinstance(params, dict):
                instance.failed("its answer has no kv_transfer_params (is it --role prefill?)")
                continue
            metrics.prefill_seconds.observe(time.perf_counter() - start)
            return params
        return None

    async def relay(
        instance: Instance,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill_leg: asyncio.Future | None = None,
    ) -> Response:
        """Send the request to `instance` and give its answer to the client as it comes. A
        client that goes away closes the upstream stream, which aborts the request there, and
        cancels `prefill_leg` (a streamed request's, which aborts it on its instance)."""
        client = pool().client
        instance.in_flight += 1
        instance.num_requests += 1
        metrics.requests.labels(instance.url, instance.role).inc()
        try:
            upstream = await client.send(
                client.build_request("POST", f"{instance.url}{path}", json=body, headers=headers),
                stream=True,
            )
        except asyncio.CancelledError:  # the client went away: the upstream request closes
            instance.in_flight -= 1
            if prefill_leg is not None:
                prefill_leg.cancel()
            raise
        except httpx.HTTPError as error:
            instance.in_flight -= 1
            instance.failed(f"{type(error).__name__}: {error}")
            metrics.failures.labels(instance.url, instance.role).inc()
            if prefill_leg is not None:
                prefill_leg.cancel()
            return _error(
                503, f"the {instance.role} instance did not answer: {error}",
                "service_unavailable",
            )  # fmt: skip
        if upstream.status_code >= 500:
            note_server_error(instance, path, upstream.status_code)

        closed = False

        async def close() -> None:
            """Once, whether the answer was relayed whole, cut short, or never started (a
            client gone as its headers came: Starlette then runs only the background task)."""
            nonlocal closed
            if closed:
                return
            closed = True
            instance.in_flight -= 1
            await upstream.aclose()
            if prefill_leg is not None and not prefill_leg.done():
                prefill_leg.cancel()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await close()

        media_type = upstream.headers.get("content-type", "application/json")
        return StreamingResponse(
            chunks(), upstream.status_code, media_type=media_type, background=BackgroundTask(close)
        )

    async def serve(request: Request, kind: str, path: str) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        headers = forward_headers(request)
        route = _route(kind, body)
        metrics.routes.labels(route).inc()
        if route == "split" and settings.kv_streaming:
            streaming_from = pool().choose("prefill")
            if streaming_from is not None and streaming_from.kv_endpoint is not None:
                return await streamed_split(request, streaming_from, path, body, headers)
        if route == "split":
            params = await _until_disconnect(request, prefill(path, body, headers))
            if isinstance(params, Response):
                return params
            if params is None:
                metrics.prefill_fallbacks.inc()
                logger.warning("no prefill instance served a request: the decode instance will")
            else:
                body = {**body, "kv_transfer_params": params}
            route = "decode"
        instance = pool().choose(route)
        if instance is None:
            return _error(
                503, f"no healthy {route} instance: see the router's /health",
                "service_unavailable",
            )  # fmt: skip
        return await _until_disconnect(request, relay(instance, path, body, headers))

    async def streamed_split(
        request: Request,
        prefill_instance: Instance,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> Response:
        """Both legs at once, tied by a transfer id. A prefill leg that fails ends the
        transfer on its instance's KV channel, so the decode instance computes the prompt
        itself at once (or, if that instance is gone, when its connection is refused)."""
        decode_instance = pool().choose("decode")
        if decode_instance is None:
            return _error(503, "no healthy decode instance: see the router's /health",
                          "service_unavailable")  # fmt: skip
        transfer_id = uuid.uuid4().hex
        kv_endpoint = prefill_instance.kv_endpoint
        assert kv_endpoint is not None
        start = time.perf_counter()

        async def prefill_leg() -> None:
            leg_body = prefill_body(body, transfer_id)
            try:
                response = await post(prefill_instance, path, leg_body, headers)
            except Exception as error:  # post() turns HTTP errors into None: anything else
                logger.error("prefill leg of transfer %s: %s", transfer_id, error)
                response = None
            if response is not None and response.status_code == 200:
                metrics.prefill_seconds.observe(time.perf_counter() - start)
                return
            metrics.prefill_fallbacks.inc()
            status = None if response is None else response.status_code
            logger.warning("prefill leg of transfer %s failed (%s): the decode instance "
                           "computes the prompt", transfer_id, status)  # fmt: skip
            end_transfer(kv_endpoint, transfer_id)

        leg = asyncio.ensure_future(prefill_leg())
        metrics.streamed.inc()
        params = {"do_remote_prefill": True, "remote_host": kv_endpoint[0],
                  "remote_port": kv_endpoint[1], "transfer_id": transfer_id}  # fmt: skip
        decode_body = {**body, "kv_transfer_params": params}
        response = await _until_disconnect(
            request, relay(decode_instance, path, decode_body, headers, leg)
        )
        if response.status_code == 499:  # the client went before the decode leg answered
            leg.cancel()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions", "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat", "/v1/chat/completions")

    async def forward_get_or_post(request: Request, path: str) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        instance = pool().choose("decode") or pool().choose("prefill")
        if instance is None:
            return _error(503, "no healthy instance: see the router's /health",
                          "service_unavailable")  # fmt: skip
        try:
            response = await pool().client.request(
                request.method, f"{instance.url}{path}", content=await request.body(),
                headers={**forward_headers(request),
                         "content-type": request.headers.get("content-type", "application/json")},
            )  # fmt: skip
        except httpx.HTTPError as error:
            instance.failed(f"{type(error).__name__}: {error}")
            return _error(503, f"the instance did not answer: {error}", "service_unavailable")
        return Response(
            response.content, response.status_code,
            media_type=response.headers.get("content-type"),
        )  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward_get_or_post(request, "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await forward_get_or_post(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await forward_get_or_post(request, "/detokenize")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one instance of each role is healthy; every instance's state."""
        instances = pool().instances
        ready = all(any(i.healthy for i in pool().of_role(r)) for r in ("prefill", "decode"))
        return JSONResponse(
            {"healthy": ready, "instances": [i.describe() for i in instances]},
            status_code=200 if ready else 503,
        )

    @app.get("/version")
    async def version() -> dict:
        return {"version": tandem.__version__}

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(metrics.render(pool()), media_type="text/plain; version=0.0.4")

    return app


def end_transfer(kv_endpoint: tuple[str, int], transfer_id: str) -> None:
    """Tell a prefill instance's KV channel that a transfer will not come: a decode instance
    waiting for it is answered at once (and prefills), and a late prefill leg is not kept.
    Best effort: a prefill instance that is gone refuses the decode instance's pull anyway."""
    socket = _ZMQ_CONTEXT.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 1000)  # the message leaves even though we close at once
    try:
        socket.connect(f"tcp://{kv_endpoint[0]}:{kv_endpoint[1]}")
        socket.send(msgspec.msgpack.encode(Release([], [transfer_id])))
    except zmq.ZMQError as error:
        logger.warning("could not end transfer %s at %s: %s", transfer_id, kv_endpoint, error)
    finally:
        socket.close()


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelled (and its upstream request with it) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


def run_router(
    prefill_urls: list[str],
    decode_urls: list[str],
    host: str,
    port: int,
    api_key: str | None = None,
    poll_interval: float = 1.0,
    request_timeout: float = 600.0,
    discover: bool = False,
    kv_streaming: bool = True,
) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll otherwise
    settings = RouterSettings(api_key, request_timeout, kv_streaming)
    app = build_router(prefill_urls, decode_urls, settings, poll_interval, discover)
    logger.info(
        "router on http://%s:%d: prefill %s, decode %s",
        host, port, ", ".join(prefill_urls), ", ".join(decode_urls),
    )  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="warning")
